"""A bounded memory of recently seen ids (no network I/O).

Used for cancels: a cancel can arrive before what it cancels (a request still waiting in the work
queue, a job whose acceptance was delayed), so dispatchers and node agents remember cancelled
request ids and refuse to start them later (docs/services.md, "NATS outages").
"""

from __future__ import annotations

from collections import OrderedDict


class RecentIds:
    """The last ``capacity`` distinct ids added, oldest forgotten first.

    ``add`` and ``in`` are O(1). Raises ValueError for a capacity < 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, item: str) -> None:
        """Remember ``item`` (moving it to the newest end if it was known)."""
        self._ids[item] = None
        self._ids.move_to_end(item)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def discard(self, item: str) -> None:
        """Forget ``item`` (nothing if unknown)."""
        self._ids.pop(item, None)

    def __contains__(self, item: object) -> bool:
        return item in self._ids

    def __len__(self) -> int:
        return len(self._ids)
