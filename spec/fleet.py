"""A fleet: engines behind one router that share one store (``store``). Each engine is a ``World`` with its own
scheduler, GPU pool, workers and connector (and its connector's tier); engines of one KV identity share records,
and no other engine ever sees them (``records.Namespace``).

An engine may crash and restart: it comes back with an empty GPU pool and an empty tier, its requests lost, and finds
the store as the fleet left it. Its records from before the crash are its to load again, as long as its weights are
the same (a restart loads the weights of its checkpoint, whatever updates it had before). A checkpoint may have
changed meanwhile (a fine-tune redeployed to the same path): the engine restarts on other weights, under the same
model and name.
"""

from __future__ import annotations

from typing import Callable, Iterator

from attrs import define, field

from . import invariants
from .executor import Executor
from .store import Store
from .world import World


@define
class Fleet:
    make: Callable[[int, int], World]  # a fresh engine for slot i on checkpoint weights w (start, each restart)
    size: int
    store: Store | None = None
    engines: list[World] = field()
    retired: list[World] = field(factory=list)  # engines that crashed: their counts still count

    @engines.default
    def _start(self) -> list[World]:
        return [self.make(i, 0) for i in range(self.size)]

    def engine(self, i: int) -> World:
        return self.engines[i % len(self.engines)]

    def restart(self, i: int, weights: int = 0) -> None:
        """Engine ``i`` crashes (its transfers in flight die with it) and starts again, empty, on the weights its
        checkpoint holds now (0: those it held at the start)."""
        self.retired.append(self.engine(i))
        self.engines[i % len(self.engines)] = self.make(i % len(self.engines), weights)

    def step(self) -> None:
        """One step of every engine, in a fixed order."""
        for engine in self.engines:
            engine.step()

    def executors(self) -> Iterator[Executor]:
        for engine in self.engines:
            yield from engine.executors

    def check(self) -> None:
        for engine in self.engines:
            engine.check()
        if self.store is not None:
            invariants.capacity(self.store)
            invariants.keep(self.store)

    def stats(self) -> Iterator[dict[str, int]]:
        for engine in (*self.retired, *self.engines):
            yield engine.stats
