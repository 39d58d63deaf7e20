"""Failures Hypothesis found, kept as explicit programs. Each docstring says what broke and what fixed it."""

import subprocess
import sys
import textwrap

from kvoffload.spec import Config, Executor, ListKV, SpecConnector, World

DELAYED_FREES_PROGRAM = textwrap.dedent("""
    from kvoffload.reference import ReferenceConnector, TensorKV
    from kvoffload.spec.kit import make_machine
    from tests.stateful.scenarios import SCENARIOS

    machine = make_machine(ReferenceConnector, SCENARIOS["k2-immediate-failures"], "exact", TensorKV)
    state = machine()
    state.add_requests(batch=[([0], 1), ([0], 1), ([0, 1, 0, 1, 2, 2, 0], 1)])
    for _ in range(6):
        state.reset_prefix_cache()
    state.step(n=2)
    for _ in range(4):
        state.reset_prefix_cache()
    state.add_requests(batch=[([0], 1)])
    state.abort(i=0)
    state.add_requests(batch=[([0], 1), ([0, 1, 0, 1, 2, 2, 0], 2), ([0, 0, 0], 3),
                              ([0, 1, 0, 1, 2, 2, 0, 0, 0, 0, 0], 2)])
    state.add_requests(batch=[([0, 1, 0, 1, 2, 2, 0], 1), ([0, 1, 0, 1, 2, 2, 0], 1)])
    state.step(n=4)
    state.invariants_hold()
    state.teardown()
    print("equal")
""")


def test_delayed_frees_do_not_depend_on_set_order_shrunk_program():
    """Found in the k2-immediate-failures scenario: the world freed the blocks of the requests in
    ``finished_sending`` in set iteration order, which differs between two sets built differently, so the
    reference's and the spec's worlds reused blocks in different orders and diverged ('requests differ' at step 6).
    Fixed: the world sorts."""
    done = subprocess.run([sys.executable, "-c", DELAYED_FREES_PROGRAM], capture_output=True, text=True,
                          env={"PYTHONHASHSEED": "3", "PATH": ""}, cwd=__file__.rsplit("/tests/", 1)[0])
    assert done.returncode == 0 and "equal" in done.stdout, done.stderr[-3000:]


class BackwardsSet(frozenset):
    """A set that iterates in the opposite of sorted order: an adversarial but legal connector answer."""

    def __iter__(self):
        return iter(sorted(frozenset.__iter__(self), reverse=True))


class BackwardsReports(SpecConnector):
    def get_finished(self, finished_req_ids):
        out = super().get_finished(finished_req_ids)
        return type(out)(BackwardsSet(out.finished_sending), BackwardsSet(out.finished_recving), out.job_results)


def test_delayed_frees_do_not_depend_on_set_order():
    config = Config(num_gpu_blocks=6, tier_blocks=8)  # every block in use: the free order decides reuse
    worlds = [World(config, cls(config), ListKV(6), Executor(delay=2)) for cls in (SpecConnector, BackwardsReports)]
    for world in worlds:
        for prompt in ([0, 1, 2, 0], [1, 1, 1, 2], [2, 0, 2, 0, 1]):
            world.add_request(prompt, max_tokens=1)  # all finish at step 1 with stores in flight: delayed frees
        for _ in range(4):
            world.step()
        world.add_request([2, 2, 2, 2, 2, 2], max_tokens=2)  # reuses the freed blocks
        world.step()
    assert worlds[0].stats["finished"] == 3
    assert worlds[0].snapshot() == worlds[1].snapshot()


def test_impl_load_that_starts_inside_an_offload_block():
    """Found in k2-immediate-failures: a load whose first offload block is partly on the GPU already (GPU prefix hit
    of 1 block, offload blocks of 2) has fewer GPU blocks than 2 x keys; the production connector mapped copies to
    keys by division and raised IndexError. Fixed: each copy carries the index of its key."""
    from functools import partial

    import torch

    from kvoffload.impl import OffloadConnector, LayeredKV
    from kvoffload.spec.kit import make_machine

    from .scenarios import SCENARIOS

    kv = partial(LayeredKV, shape="mla", dtype=torch.float32)
    state = make_machine(OffloadConnector, SCENARIOS["k2-immediate-failures"], "exact", kv)()
    state.add_requests(batch=[([0, 1, 0, 1, 2, 2, 0, 0, 0, 0, 0], 9), ([0, 0, 0], 8),
                              ([1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1, 0], 1)])
    state.invariants_hold()
    state.step(n=4)
    state.invariants_hold()
    state.step(n=6)
    state.invariants_hold()
    state.teardown()
