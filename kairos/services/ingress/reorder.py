"""Tokens that arrive ahead of a gap wait a moment for the missing ones.

A request's token events carry their index; the ingress relays them in index order and a gap
used to end the stream at once (``stream_interrupted``). In a NATS cluster a gap is often only
late: when the server a node agent was connected to dies, the events it had in flight are lost,
the agent reconnects to another member, nats-py sends what was published meanwhile, and then the
agent publishes the lost ones again (``kairos/services/node_agent/outbox.py``) — they arrive after the
later ones. :class:`Reorder` holds the events of the followed attempt that come ahead of the
next expected index (a token event past it, a done event counting more tokens than relayed) for
at most ``wait_s``; the events filling the gap are relayed first, then the held ones in order. A
gap still open after ``wait_s`` is handed on as it is: the lifecycle then sees the gap
(``stream_interrupted``) as before. Nothing is relayed out of order or twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kairos.contracts.events import DoneEvent, TokenEvent

#: how long (s) events ahead of a gap wait for it to be filled
GAP_WAIT_S = 1.5


class Reorder:
    """The held events of one request's followed attempt.

    Args:
        wait_s: longest hold, s (>= 0; 0 holds nothing).
        clock: monotonic seconds.

    Raises:
        ValueError: ``wait_s`` < 0.
    """

    def __init__(self, wait_s: float = GAP_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        if wait_s < 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s!r}")
        self.wait_s, self.clock = wait_s, clock
        self._held: list[TokenEvent | DoneEvent] = []
        self._since: float | None = None  #: monotonic s when the oldest held event came

    def hold(self, ev, attempt_id: str, received: int) -> bool:
        """Keep ``ev`` back if it is ahead of token index ``received`` of ``attempt_id`` (True),
        while the gap's wait has not run out; else False (relay it now)."""
        if not self.wait_s or getattr(ev, "request_id", None) != attempt_id:
            return False
        ahead = (isinstance(ev, TokenEvent) and ev.first_index > received) or \
                (isinstance(ev, DoneEvent) and ev.completion_tokens > received)
        if not ahead or (self._since is not None and self.clock() - self._since >= self.wait_s):
            return False
        if self._since is None:
            self._since = self.clock()
        self._held.append(ev)
        return True

    def ready(self, received: int):
        """A held event to relay now: the one that continues at ``received`` (the gap was filled),
        or — the wait over — the lowest held one (its gap then shows). None otherwise."""
        if not self._held:
            return None
        self._held.sort(key=lambda e: e.first_index if isinstance(e, TokenEvent) else e.completion_tokens + 1)
        first = self._held[0]
        fits = (first.first_index <= received) if isinstance(first, TokenEvent) else first.completion_tokens <= received
        if fits or self.time_left() == 0.0:
            self._held.pop(0)
            if not self._held:
                self._since = None
            return first
        return None

    def time_left(self) -> float | None:
        """Seconds until the held events are handed on as they are (None: nothing held)."""
        if self._since is None:
            return None
        return max(0.0, self.wait_s - (self.clock() - self._since))

    def clear(self) -> None:
        """Forget everything (the attempt was given up)."""
        self._held.clear()
        self._since = None

    def __len__(self) -> int:
        return len(self._held)
