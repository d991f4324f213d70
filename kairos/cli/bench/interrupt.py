"""Stopping a ``kairos bench`` run early on SIGINT (Ctrl-C) or SIGTERM, keeping what it measured.

Inputs: the signals, through :func:`stop_on_signals` (Python handlers, main thread only), or a
direct :meth:`Interrupt.request` (tests, callers). Outputs: the :class:`Interrupt` the replay
(:func:`kairos.cli.bench.client.run_bench`) watches: once requested, no new request is sent, the
requests in flight are cancelled (their connections closed, so the server cancels them), and the
run reports what finished, marked as interrupted; :func:`exit_status` is then 128 + the signal
number (130 for SIGINT, 143 for SIGTERM, as shells report a program killed by it). A second signal
aborts at once (KeyboardInterrupt for SIGINT, ``SystemExit(143)`` for SIGTERM), as ``asyncio.run``
does on a second Ctrl-C.

Without these handlers ``asyncio.Runner`` (``kairos.runtime.service.run_on_event_loop``, uvloop
too) turned SIGINT into a cancelled main task and a bare ``Aborted!``, and SIGTERM killed the
process: both threw away every request measured so far (a new user's trial).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """A request to stop a run early: which signal asked (None: not asked). :meth:`request` is safe
    from a signal handler and from another thread; the run's event loop learns of it through the
    event :meth:`attach` returns."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    @property
    def name(self) -> str | None:
        """The signal's name (``SIGINT``), None when not interrupted."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def attach(self) -> asyncio.Event:
        """Called by the run inside its event loop: the event set on :meth:`request` (already set
        if a request came first)."""
        self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        if self.signum is not None:
            self._event.set()
        return self._event

    def request(self, signum: int) -> None:
        """Stop the run (``signum``: the signal that asked). A second request aborts at once.

        Raises:
            KeyboardInterrupt: a second request, when it is SIGINT.
            SystemExit: a second request of another signal (128 + its number).
        """
        if self.signum is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.signum = signum
        loop, event = self._loop, self._event
        if loop is not None and event is not None and not loop.is_closed():
            loop.call_soon_threadsafe(event.set)


@contextmanager
def stop_on_signals(interrupt: Interrupt, signals: Sequence[int] = STOP_SIGNALS) -> Iterator[Interrupt]:
    """While inside, each of ``signals`` calls ``interrupt.request`` instead of its handler; the
    previous handlers come back on the way out. Nothing is installed off the main thread (Python
    delivers signals there only), nor for a signal the process ignores (a shell's background job
    ignores SIGINT)."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in signals:
            old = signal.getsignal(sig)
            if old is signal.SIG_IGN:
                continue
            previous[sig] = old
            signal.signal(sig, lambda signum, _frame: interrupt.request(signum))
    try:
        yield interrupt
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


def exit_status(report: dict[str, Any]) -> int | None:
    """The exit status of an interrupted run's report (128 + the signal's number: 130 for SIGINT,
    143 for SIGTERM), None when the run was not interrupted."""
    info = report.get("interrupted")
    if not info:
        return None
    return 128 + signal.Signals[info["signal"]].value
