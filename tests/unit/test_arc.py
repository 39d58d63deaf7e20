"""ARC against its published definition (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead Replacement Cache",
FAST 2003, figure 4), written out here as a page cache, line by line. The spec's ARC and the production ARC, driven
as page caches (every key evictable, one eviction per miss once full), must hold the same lists and target."""

from hypothesis import given
from hypothesis import strategies as st

from kvoffload.impl.policies import ARCPolicy
from kvoffload.spec.tier import ARC


class PaperARC:
    """Figure 4. Lists are LRU first; p is an integer target (the paper's ratios rounded down)."""

    def __init__(self, c: int) -> None:
        self.c, self.p = c, 0
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[int] = []
        self.b2: list[int] = []

    def replace(self, x: int) -> None:
        if self.t1 and ((x in self.b2 and len(self.t1) == self.p) or len(self.t1) > self.p):
            self.b1.append(self.t1.pop(0))
        else:
            self.b2.append(self.t2.pop(0))

    def request(self, x: int) -> None:
        if x in self.t1 or x in self.t2:  # case I
            (self.t1 if x in self.t1 else self.t2).remove(x)
            self.t2.append(x)
        elif x in self.b1:  # case II
            self.p = min(self.c, self.p + max(len(self.b2) // len(self.b1), 1))
            self.replace(x)
            self.b1.remove(x)
            self.t2.append(x)
        elif x in self.b2:  # case III
            self.p = max(0, self.p - max(len(self.b1) // len(self.b2), 1))
            self.replace(x)
            self.b2.remove(x)
            self.t2.append(x)
        else:  # case IV
            total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
            if len(self.t1) + len(self.b1) == self.c:  # case A
                if len(self.t1) < self.c:
                    self.b1.pop(0)
                    self.replace(x)
                else:
                    self.t1.pop(0)
            elif total >= self.c:  # case B
                if total == 2 * self.c:
                    self.b2.pop(0)
                self.replace(x)
            self.t1.append(x)


def as_page_cache(policy, c: int, x: int) -> None:
    """What the tier does for one request when every entry is evictable: a hit is a touch; a miss chooses one
    victim once the tier is full, inserts, then evicts the victim (the tier's order)."""
    if x in policy.keys():
        policy.touch(x)
        return
    victims = policy.victims(1, lambda key: True, [x]) if len(policy.keys()) == c else []
    policy.insert(x)
    for victim in victims:
        policy.evict(victim)


def lists(arc) -> tuple:
    return arc.p, list(arc.t1), list(arc.t2), list(arc.b1), list(arc.b2)


@given(c=st.integers(1, 5), trace=st.lists(st.integers(0, 9), max_size=80))
def test_spec_and_production_arc_follow_the_paper(c, trace):
    paper, spec, production = PaperARC(c), ARC(c), ARCPolicy(c)
    for x in trace:
        paper.request(x)
        as_page_cache(spec, c, x)
        as_page_cache(production, c, x)
        assert lists(spec) == lists(paper), f"request {x}"
        assert lists(production) == lists(paper), f"request {x}"
        assert len(spec.t1) + len(spec.b1) <= c and len(spec.keys()) + len(spec.b1) + len(spec.b2) <= 2 * c


def test_the_paper_check_catches_the_old_ghost_bound():
    """The old spec ARC bounded each ghost list by c alone, so |t1|+|b1| reached 2c and ghost hits went to t1."""
    spec = ARC(2)
    for x in (0, 1, 2, 3):
        as_page_cache(spec, 2, x)
    assert len(spec.t1) + len(spec.b1) <= 2
    as_page_cache(spec, 2, 2)  # a b1 ghost comes back: used again
    assert 2 in spec.t2
