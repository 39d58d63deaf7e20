"""How KV cache groups are written and read back (the hunt's ``--groups``, the bench's, scenario names)."""

import pytest

from kvoffload.spec import ConfigError
from kvoffload.spec.groups import Group, parse_groups


def test_groups_are_read_as_they_are_written():
    assert parse_groups("4,full") == (Group(4), Group())
    assert parse_groups("8@4, full") == (Group(8, block_size=4), Group())
    assert ",".join(map(str, parse_groups("8@4,full@2,6"))) == "8@4,full@2,6"


@pytest.mark.parametrize("text", ["sliding", "4@", "full@x", ""])
def test_a_group_that_cannot_be_read_is_one_clear_error(text):
    with pytest.raises(ConfigError, match=f"cannot read KV cache group {text!r}"):
        parse_groups(text)
