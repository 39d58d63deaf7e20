"""The public strategies: what the kit's requests look like."""

from __future__ import annotations

from hypothesis import strategies as st

SHARED_PREFIXES = ((), (0, 1, 0, 1, 2, 2), (1, 1, 0, 0, 1, 1, 2, 2, 0, 1, 0, 1))


def prompts() -> st.SearchStrategy[list[int]]:
    """Prompts over a 3-token alphabet, often behind a shared prefix, so prefix hits are common."""
    return st.builds(lambda head, tail: [*head, *tail], st.sampled_from(SHARED_PREFIXES),
                     st.lists(st.integers(0, 2), min_size=1, max_size=8))


def max_tokens() -> st.SearchStrategy[int]:
    return st.integers(1, 10)
