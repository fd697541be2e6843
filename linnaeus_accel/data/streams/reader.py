"""Reading a stream in order, counting items: the reader ``StreamShard`` gives each of its
passes (skip to a position, take items, keep the few that pad a pass's last batch)."""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

END = object()  # the end of a pass, where an item would be


class StreamError(ValueError):
    """A stream, or a saved stream position, that cannot give the batches the schedule expects."""


class StreamReader:
    """The stream's iterator, its position in the pass, and the few items kept to pad the last batch.

    ``size`` None: a stream without ``__len__``, whose end is wherever it ends (reading past it
    returns fewer items instead of failing); ``last`` is then the last item read."""

    def __init__(self, stream: Iterator[Any], position: int, size: int | None, keep: set[int]) -> None:
        self.it, self.pos, self.size = stream, position, size
        self.keep = sorted(keep)
        self.kept: dict[int, Any] = {}
        self.last: Any = END

    def _keep_between(self, start: int, end: int) -> list[int]:
        return self.keep[bisect_left(self.keep, start) : bisect_left(self.keep, end)]

    def _short(self) -> StreamError:
        return StreamError(
            f"the stream yielded {self.pos} items but len() says {self.size}: __len__ must be the exact number of items per pass (all processes together)"
        )

    def _advance(self, n: int) -> None:
        if self.size is None:  # keep the last item: it may have to pad the pass's last batch
            for item in itertools.islice(self.it, n):
                self.last = item
                self.pos += 1
            return
        count = sum(1 for _ in itertools.islice(self.it, n))
        self.pos += count
        if count < n:
            raise self._short()

    def skip_to(self, target: int) -> None:
        for q in self._keep_between(self.pos, target):
            self._advance(q - self.pos)
            self.take(1)  # keeps the item at q
        self._advance(target - self.pos)

    def take(self, n: int) -> list[Any]:
        items = list(itertools.islice(self.it, n))
        start, self.pos = self.pos, self.pos + len(items)
        if items:
            self.last = items[-1]
        if len(items) < n and self.size is not None:
            raise self._short()
        for q in self._keep_between(start, self.pos):
            self.kept[q] = items[q - start]
        return items

    def drain(self) -> None:
        """Read to the end of the pass: only a reader that sees the end can check ``len()``."""
        assert self.size is not None
        self.skip_to(self.size)
        if next(self.it, END) is not END:
            raise StreamError(
                f"the stream yielded more than {self.size} items in one pass but len() says {self.size}: __len__ must be the exact number of items per pass (all processes together)"
            )
