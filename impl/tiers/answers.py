"""Existence checks in flight (``spec.store.Answer``): one answered at once, one running on a thread."""

from __future__ import annotations

import time
from concurrent.futures import Future


class IndexAnswer:
    """An existence check, answered when asked (from an index the tier keeps): never waited for."""

    __slots__ = ("found",)

    def __init__(self, found: list[bool]) -> None:
        self.found = found

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> list[bool]:
        return self.found

    def waited(self) -> float:
        return 0.0


class FutureAnswer:
    """An existence check running on one of the tier's threads: the engine does not wait for it."""

    __slots__ = ("asked_at", "future")

    def __init__(self, future: Future[list[bool]]) -> None:
        self.asked_at, self.future = time.monotonic(), future

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> list[bool]:
        return self.future.result(timeout)

    def waited(self) -> float:
        return time.monotonic() - self.asked_at
