"""Survive a NATS restart or a cluster member's loss: re-declare and restart watchers after a reconnect.

nats-py re-subscribes core subscriptions by itself, but a restarted server may have lost streams and
buckets (empty store), and JetStream watchers may sit on consumers that no longer exist; a service
hands :class:`BusWatch` its re-declare coroutine (docs/bus.md "Surviving a NATS restart").
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import structlog
from nats.aio.client import Client

_log = structlog.get_logger("kairos.runtime")

class BusWatch:
    """Follows one connection's ups and downs and re-establishes what a NATS restart loses.

    nats-py re-subscribes core subscriptions by itself after a reconnect, but a restarted server
    may have lost streams/buckets (empty store) and JetStream watchers (ordered push consumers) may
    be left on a consumer that no longer exists. After every reconnect ``on_reconnect()`` (the
    service's re-declare + restart-watchers coroutine) is retried every ``retry_s`` until it
    succeeds, and run again when another reconnect came meanwhile; ``on_connected()`` runs at once
    on every reconnect, also one during a re-declare under way (what needs core NATS only: it must
    not wait for JetStream); ``on_disconnect()`` runs when the connection drops. The connection is polled every
    ``poll_s`` (no private nats-py callbacks; the stats counter ``reconnects`` tells a reconnect).

    Attributes:
        disconnected_since: ``time.monotonic()`` when the connection was lost, None while connected
            (cleared at the reconnect, before the re-declare: a NATS cluster may take seconds to
            elect JetStream leaders after a member died, and messages flow meanwhile).
        resuming: reconnected, ``on_reconnect()`` not done yet (JetStream not answering yet).
        outage_s: the last outage's length, s (None: none yet, or shorter than one poll).
        reconnected_at: ``time.monotonic()`` of the last reconnect seen (None: never reconnected).
        connected_at: ``time.monotonic()`` when this watch started (the service's first connection).
        reconnects: reconnects handled so far.
    """

    def __init__(self, nc: Client, on_reconnect: Callable[[], Awaitable[None]],
                 on_disconnect: Callable[[], Awaitable[None]] | None = None, log=None,
                 poll_s: float = 0.1, retry_s: float = 0.25,
                 on_connected: Callable[[], Awaitable[None]] | None = None) -> None:
        self.nc, self.on_reconnect, self.on_disconnect, self.log = nc, on_reconnect, on_disconnect, log
        self.on_connected = on_connected
        self.poll_s, self.retry_s = poll_s, retry_s
        self.disconnected_since: float | None = None
        self.reconnected_at: float | None = None
        self.connected_at = time.monotonic()
        self.reconnects = 0
        self.resuming = False
        self.outage_s: float | None = None
        self._seen = nc.stats.get("reconnects", 0)
        self._task: asyncio.Task | None = None
        self._resume_task: asyncio.Task | None = None  #: the re-declare loop after a reconnect (:meth:`_resume`)
        self._generation = 0  #: reconnects seen by the watch loop
        self._resumed = 0  #: of them, those a finished re-declare covered

    def start(self) -> "BusWatch":
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        for task in (self._task, self._resume_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while not self.nc.is_closed:
            await asyncio.sleep(self.poll_s)
            if not self.nc.is_connected:
                if self.disconnected_since is None:
                    self.disconnected_since = time.monotonic()
                    if self.on_disconnect is not None:
                        await self._safe(self.on_disconnect, "bus_disconnect_hook_failed")
                continue
            n = self.nc.stats.get("reconnects", 0)
            idle = self._resume_task is None or self._resume_task.done()
            if n == self._seen and self.disconnected_since is None and not (self.resuming and idle):
                continue
            self._seen = n
            self._generation += 1
            self.reconnected_at = time.monotonic()
            # connected again: the outage is over, even while JetStream is still electing leaders
            # (a cluster member died) and the re-declare keeps failing; core NATS (tokens, jobs,
            # heartbeats) flows already
            # (None: the reconnect came within one poll, the loss was never seen)
            self.outage_s = None if self.disconnected_since is None else self.reconnected_at - self.disconnected_since
            self.disconnected_since = None
            self.resuming = True
            if self.on_connected is not None:  # once per reconnect, at once (core NATS only)
                await self._safe(self.on_connected, "bus_connected_hook_failed")
            if idle:
                self._resume_task = asyncio.create_task(self._resume())
            # else: the re-declare under way runs once more when its attempt ends (_resume); this loop
            # goes on watching, so a reconnect during a slow re-declare (a JetStream call waiting out
            # its timeout while a cluster elects leaders) still gets its on_connected at once

    async def _resume(self) -> None:
        """Re-declare until JetStream answers, and again after every reconnect that came meanwhile
        (the server now connected may lack what the earlier attempt declared elsewhere)."""
        while True:
            generation = self._generation
            while self.nc.is_connected:  # re-declare until JetStream answers (it may still be recovering)
                if await self._safe(self.on_reconnect, "bus_resume_failed"):
                    break
                await asyncio.sleep(self.retry_s)
            else:
                return  # dropped again meanwhile: the watch loop starts over at the next reconnect
            if generation == self._generation:
                break
        self.resuming = False
        self.reconnects += self._generation - self._resumed
        self._resumed = self._generation
        if self.log is not None:
            self.log.info("bus_resumed", outage_s=None if self.outage_s is None else round(self.outage_s, 3),
                          redeclare_s=round(time.monotonic() - (self.reconnected_at or 0.0), 3))

    def settling(self, window_s: float) -> bool:
        """True while disconnected or within ``window_s`` of the last reconnect or of this
        service's first connection: other clients (node agents) may not have re-subscribed yet, so
        "no responders" proves nothing. A replica that starts just after a NATS restart meets the
        agents in the middle of their reconnect, exactly as one that reconnected itself."""
        if self.disconnected_since is not None or self.resuming or not self.nc.is_connected:
            return True
        last = max(self.connected_at, self.reconnected_at or 0.0)
        return time.monotonic() - last < window_s

    async def _safe(self, fn: Callable[[], Awaitable[None]], what: str) -> bool:
        try:
            await fn()
            return True
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a hook that failed is retried (the re-declare) or not needed again: logged
            (self.log if self.log is not None else _log).warning(what, error=repr(exc))
            return False
