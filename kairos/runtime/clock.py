"""The clocks a service's protocol logic reads, passed in as an argument (never read from a global).

A service shell gets :data:`SYSTEM_CLOCK` (the process's wall clock, monotonic clock and
``asyncio.sleep``); a unit test hands the same code a :class:`ManualClock`, whose time moves only
when the code sleeps or waits (or the test calls :meth:`ManualClock.advance`), so a retry backoff, a
deadline or a "no node for ``no_node_wait_s``" runs at once and deterministically.

Units: ``now_ms`` is wall-clock milliseconds since the epoch (the ``*_unix_ms`` fields of
:mod:`kairos.contracts.wire`); ``monotonic`` is seconds on an arbitrary origin (``time.monotonic``).
"""

from __future__ import annotations

import asyncio
import time

from kairos.contracts.wire import now_ms


class Clock:
    """The running process's clocks (the default of every service)."""

    def now_ms(self) -> float:
        """Wall clock, ms since the epoch (comparable with the wire's ``*_unix_ms``)."""
        return now_ms()

    def monotonic(self) -> float:
        """Monotonic clock, s (durations, deadlines within this process)."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a backoff; never a synchronisation)."""
        await asyncio.sleep(seconds)

    async def wait_event(self, event: asyncio.Event, timeout_s: float) -> bool:
        """Wait until ``event`` is set or ``timeout_s`` passed; True when it was set."""
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


#: the process's clocks
SYSTEM_CLOCK = Clock()


class ManualClock(Clock):
    """A clock for tests: time stands still until something sleeps or waits on it.

    ``sleep(s)`` and a ``wait_event`` that times out advance both clocks by that much at once (and
    yield to the event loop once, so other tasks run); :meth:`advance` moves them by hand.

    Args:
        now_ms: the wall clock's start, ms since the epoch.
        monotonic: the monotonic clock's start, s.
    """

    def __init__(self, now_ms: float = 1_700_000_000_000.0, monotonic: float = 1000.0) -> None:
        self._wall_ms = now_ms
        self._mono = monotonic
        self.slept: list[float] = []  #: every sleep and timed-out wait asked for, s, in order

    def now_ms(self) -> float:
        return self._wall_ms

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        """Move both clocks ``seconds`` forward."""
        self._wall_ms += seconds * 1000.0
        self._mono += seconds

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)

    async def wait_event(self, event: asyncio.Event, timeout_s: float) -> bool:
        await asyncio.sleep(0)
        if event.is_set():
            return True
        await self.sleep(timeout_s)
        return event.is_set()
