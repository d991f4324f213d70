"""Asyncio subscriber of the engine-state stream (:mod:`kairos.engines.vllm.plugin.protocol`); no vLLM import.

Usage (in the node agent)::

    async with EngineStateSubscriber("ipc:///tmp/kairos-decode-0.sock") as sub:
        async for snap in sub:          # EngineSnapshot, in publication order
            ...
        # or: snap = await sub.recv(timeout_s=1.0)

ZMQ SUB semantics apply: connecting before the engine binds is fine (ZMQ reconnects), and
messages published before the subscription reached the publisher are lost — the stream repeats
the full state at least every 100 ms, so a late subscriber only misses history.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kairos.engines.vllm.plugin.protocol import EngineSnapshot, decode

class EngineStateError(ValueError):
    """A message on the stream is not a valid :class:`EngineSnapshot` (the text names the field)."""


class EngineStateSubscriber:
    """ZMQ SUB socket connected to one engine's state publisher.

    ``addr`` is the publisher's address (``ipc:///path`` or ``tcp://host:port``, the value of
    ``$KAIROS_ENGINE_STATE_ADDR`` in the engine process). ``dropped`` counts messages lost between
    the publisher and this subscriber (gaps in ``seq`` within one engine process).
    Raises :class:`zmq.ZMQError` on a malformed address.
    """

    def __init__(self, addr: str, *, ctx: zmq.asyncio.Context | None = None) -> None:
        self.addr = addr
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        # connection events, before connect so none is missed (zmq_socket_monitor)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(addr)
        self._last: tuple[int, int] | None = None  # (engine_pid, seq) of the last message
        self.dropped = 0
        self.received = 0

    async def recv(self, timeout_s: float | None = None) -> EngineSnapshot:
        """The next snapshot.

        Raises :class:`TimeoutError` when nothing arrives within ``timeout_s`` seconds (an engine
        publishes at least every 0.1 s, so a long silence means it is gone or stuck), and
        :class:`EngineStateError` when the message does not decode.
        """
        if timeout_s is None:
            data = await self._sock.recv()
        else:
            data = await asyncio.wait_for(self._sock.recv(), timeout_s)
        try:
            snap = decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise EngineStateError(f"engine state from {self.addr}: {e}") from e
        if self._last is not None and self._last[0] == snap.engine_pid and snap.seq > self._last[1] + 1:
            self.dropped += snap.seq - self._last[1] - 1
        self._last = (snap.engine_pid, snap.seq)
        self.received += 1
        return snap

    async def disconnected(self) -> None:
        """Return when the connection to the publisher closes: its process died or closed the
        socket (ZMQ's ``EVENT_DISCONNECTED``, at once, where the stream's silence takes 100 ms or
        more to mean anything). ZMQ reconnects by itself; a new engine's first message follows."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                return

    def __aiter__(self) -> "EngineStateSubscriber":
        return self

    async def __anext__(self) -> EngineSnapshot:
        if self._sock.closed:
            raise StopAsyncIteration
        return await self.recv()

    def close(self) -> None:
        """Close the socket (idempotent); a pending ``recv`` fails with ``zmq.ZMQError``."""
        if not self._sock.closed:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)

    async def __aenter__(self) -> "EngineStateSubscriber":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


async def follow(sub: EngineStateSubscriber, stop: asyncio.Event,
                 on_snapshot: Callable[[EngineSnapshot], Awaitable[None]], on_lost: Callable[[str], None],
                 on_bad: Callable[[str], None]) -> None:
    """Follow ``sub`` until ``stop`` is set: every snapshot is awaited in ``on_snapshot`` (in
    publication order), the connection closing calls ``on_lost(why)`` at once (the engine process
    died; ZMQ reconnects by itself), a message that does not decode is passed to ``on_bad(why)``
    (the caller logs it) and skipped. Closes nothing: the caller owns ``sub``. No logging library
    here: this module is imported in the vLLM virtualenv too (tests/vllm/inproc)."""
    stop_wait = asyncio.ensure_future(stop.wait())
    recv, gone = asyncio.ensure_future(sub.recv()), asyncio.ensure_future(sub.disconnected())
    try:
        while not stop.is_set():
            await asyncio.wait({recv, gone, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                break
            if gone.done():
                gone.result()
                on_lost("engine-state stream disconnected")
                gone = asyncio.ensure_future(sub.disconnected())
            if not recv.done():
                continue
            try:
                snap = recv.result()
            except EngineStateError as exc:  # a bad message; keep listening
                on_bad(str(exc))
                snap = None
            recv = asyncio.ensure_future(sub.recv())
            if snap is not None:
                await on_snapshot(snap)
    finally:
        for f in (stop_wait, recv, gone):
            f.cancel()
        await asyncio.gather(recv, gone, return_exceptions=True)
