"""The out events a node agent published lately, to publish again after it reconnects.

Token, done, handoff and error events (``kairos.out.<rid>.<sender>``) travel on core NATS: at
most once. When the nats-server an agent is connected to dies, what the agent had already written
to that server — a few milliseconds of events, still in the dead server's buffers or the socket's
— is gone; what it publishes while reconnecting is buffered by nats-py and sent to the new member
(issue 17 part 2: in a 3-server cluster every SIGKILL cut the streams whose events were in that
window, ``stream_interrupted``). After a reconnect the agent publishes again the events it sent in
:data:`RESEND_WINDOW_S` before the connection was lost. The ingress relays a request's tokens by
index: a repeated token is dropped as a duplicate, one that comes ahead of a gap is held until the
gap is filled (``kairos/services/ingress/reorder.py``), and a repeated done or error of a request that
has ended is dropped — so sending twice never shows twice, and nothing is made up.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

#: events sent this long (s) before the connection was seen lost are published again after the
#: reconnect (the bus watch notices a loss within its 0.1 s poll; SIGKILL resets the socket at once)
RESEND_WINDOW_S = 1.0
#: events are kept this long (s): a reconnect normally takes milliseconds, at most a few seconds
KEEP_S = 30.0


class Outbox:
    """The (time, subject, payload) of the out events published in the last ``keep_s`` seconds.

    Args:
        keep_s: how long an event is kept, s (> 0).
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: ``keep_s`` <= 0.
    """

    def __init__(self, keep_s: float = KEEP_S, clock: Callable[[], float] = time.monotonic) -> None:
        if keep_s <= 0:
            raise ValueError(f"keep_s must be > 0, got {keep_s!r}")
        self.keep_s, self.clock = keep_s, clock
        self._sent: deque[tuple[float, str, bytes]] = deque()

    def sent(self, subject: str, payload: bytes) -> None:
        """Remember one published event (and forget those older than ``keep_s``)."""
        now = self.clock()
        self._sent.append((now, subject, payload))
        while self._sent and self._sent[0][0] < now - self.keep_s:
            self._sent.popleft()

    def since(self, t0: float) -> list[tuple[str, bytes]]:
        """(subject, payload) of the events sent at monotonic time ``t0`` or later, oldest first."""
        return [(s, p) for t, s, p in self._sent if t >= t0]

    def __len__(self) -> int:
        return len(self._sent)
