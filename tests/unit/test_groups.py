"""How KV cache groups are written and read back (the hunt's ``--groups``, the bench's, scenario names), and what a
model with recurrent state is refused, each with one clear error."""

import pytest

from kvoffload.spec import Config, ConfigError, ListKV, SpecConnector, World
from kvoffload.spec.executor import Executor
from kvoffload.spec.groups import Group, parse_groups

STATE = Group(state=True)


def test_groups_are_read_as_they_are_written():
    assert parse_groups("4,full") == (Group(4), Group())
    assert parse_groups("8@4, full") == (Group(8, block_size=4), Group())
    assert ",".join(map(str, parse_groups("8@4,full@2,6"))) == "8@4,full@2,6"
    assert parse_groups("state@4,full@4") == (Group(block_size=4, state=True), Group(block_size=4))
    assert str(STATE) == "state"


@pytest.mark.parametrize("text", ["sliding", "4@", "full@x", ""])
def test_a_group_that_cannot_be_read_is_one_clear_error(text):
    with pytest.raises(ConfigError, match=f"cannot read KV cache group {text!r}"):
        parse_groups(text)


@pytest.mark.parametrize("config, says", [
    (dict(prefix_caching=False), "prefix_caching must be on"),
    (dict(groups=(STATE, Group(block_size=4))), "blocks of one size"),
    (dict(offload_block_size=4), "offload_block_size must equal block_size"),
    (dict(num_spec_tokens=2), "num_spec_tokens must be below block_size"),
])
def test_what_a_model_with_state_is_refused_is_said(config, says):
    with pytest.raises(ConfigError, match=says):
        Config(**{"groups": (STATE, Group()), **config})


def test_a_state_and_a_window_in_one_group_is_refused():
    with pytest.raises(ConfigError, match="state or a sliding window"):
        Group(4, state=True)


def test_a_model_with_state_needs_a_connector_that_takes_every_group():
    """vLLM cannot turn its hybrid manager off for a Mamba hybrid: it refuses to start, and so does the world."""
    config = Config(groups=(STATE, Group()))
    with pytest.raises(ConfigError, match="one block table per KV cache group"):
        World(config, SpecConnector(config), ListKV(config.num_gpu_blocks), Executor(0), grouped=False)
    World(config, SpecConnector(config), ListKV(config.num_gpu_blocks), Executor(0), grouped=True)
