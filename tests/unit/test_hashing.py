"""A batch's records are hashed on two threads from ``SPLIT_BYTES``: the results keep the batch's order, the first
half is hashed on the helper thread, a smaller batch stays on the caller's, and an error raised on either comes back
to the caller."""

import threading

import pytest

from kvoffload.impl.tiers.hashing import SPLIT_BYTES, each


def where(item: int) -> tuple[int, str]:
    return item, threading.current_thread().name


def test_a_large_batch_is_hashed_half_on_the_helper_in_order():
    done = each(where, range(7), SPLIT_BYTES)
    assert [item for item, _ in done] == list(range(7))
    here = threading.current_thread().name
    assert {name for _, name in done[:3]} == {"kvoffload-hash_0"} and {name for _, name in done[3:]} == {here}


def test_a_small_batch_stays_on_the_callers_thread():
    assert {name for _, name in each(where, range(7), SPLIT_BYTES - 1)} == {threading.current_thread().name}
    assert each(where, [5], SPLIT_BYTES) == [(5, threading.current_thread().name)]


@pytest.mark.parametrize("bad", [0, 6], ids=["on-the-helper", "on-the-caller"])
def test_an_error_on_either_thread_reaches_the_caller(bad):
    def hash_one(item: int) -> int:
        if item == bad:
            raise ValueError(item)
        return item
    with pytest.raises(ValueError):
        each(hash_one, range(7), SPLIT_BYTES)
