"""A hybrid model's tier keys name their block hash and group in KV events (vLLM's ``group_idx``): a later group's
key is a hash of both, so the production scheduler remembers where each came from, and forgets it only once no
event it has returned, or will return, names the key. The program below is the one vLLM's real scheduler hit
(async scheduling, two workers, failures): within one read of the events, a key is stored, evicted, allocated
again and its store fails."""

from kvoffload.impl.scheduler import OffloadScheduler
from kvoffload.spec import Config, Group, group_key


def test_origins_outlive_every_event_that_names_their_key():
    scheduler = OffloadScheduler(Config(num_gpu_blocks=8, tier_blocks=1, groups=(Group(4), Group())))
    tier, origins = scheduler.tier, {group_key(h, 1): (h, 1) for h in (12345, 12346)}
    key, other = origins

    def store(k: int, success: bool) -> None:  # what _store_groups and update_connector_output do for one key
        assert tier.prepare_store([k]) is not None
        scheduler.origin[k] = origins[k]
        tier.complete_store([k], success)
        if not success:
            scheduler._leaving.add(k)

    store(key, True)  # stored
    store(other, True)  # evicts key: removed
    store(key, False)  # evicts other, then fails: never announced
    events = scheduler.take_events()
    assert [(e.kind, e.keys) for e in events] == [("stored", (key,)), ("removed", (key,)), ("stored", (other,)),
                                                 ("removed", (other,))]
    assert all(k in scheduler.origin for e in events for k in e.keys)  # the caller reads them after this call
    assert scheduler.take_events() == []
    assert key not in scheduler.origin and other not in scheduler.origin  # gone once read: no leak
