"""The engine-state publisher: a ZMQ PUB socket that never blocks the engine loop (no vLLM import).

The scheduler plugin (:mod:`kairos.engines.vllm.plugin.scheduler`) builds an :class:`EngineSnapshot` on the engine
thread and hands it to :meth:`StatePublisher.publish`; the publisher stamps ``seq`` and
``sent_unix_ms`` and sends it with ``zmq.NOBLOCK``. A PUB socket drops messages for a subscriber
whose queue (high-water mark :data:`SNDHWM` messages) is full instead of blocking, so a slow or
absent node agent can never stall the engine. A daemon thread re-sends the latest state (without
its step record, so no step is counted twice) whenever nothing was published for
:data:`~kairos.engines.vllm.plugin.protocol.IDLE_PERIOD_S` — the "at least every 100 ms when idle" of the stream.

Both threads send on the same socket, so sends are serialised by a lock held only for the
non-blocking send (microseconds).
"""

from __future__ import annotations

import os
import threading
import time

import msgspec
import zmq

from kairos.engines.vllm.plugin.protocol import IDLE_PERIOD_S, EngineSnapshot, encode

#: Messages queued per subscriber before the PUB socket drops (ZMQ_SNDHWM). Large enough to ride
#: out a subscriber pause of a few seconds at one message per step, small enough to bound memory.
SNDHWM = 4096


class StatePublisher:
    """Publishes engine snapshots on ``addr`` (``ipc://path``, ``tcp://host:port``, ``tcp://host:*``), binding it.

    ``idle_period_s`` is the longest gap between two messages while the engine publishes nothing
    itself (seconds). ``sent`` / ``dropped`` count messages handed to ZMQ / refused by it.
    Raises :class:`zmq.ZMQError` when the address cannot be bound (in use, bad scheme).
    """

    def __init__(self, addr: str, *, idle_period_s: float = IDLE_PERIOD_S) -> None:
        if idle_period_s <= 0:
            raise ValueError(f"idle_period_s must be > 0, got {idle_period_s}")
        self.addr = addr
        self.idle_period_s = idle_period_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, SNDHWM)
        try:
            self._sock.bind(addr)
        except zmq.ZMQError:
            self._sock.close(linger=0)
            self._ctx.term()
            raise
        #: the bound endpoint (a ``tcp://host:*`` address resolves to the chosen port)
        self.addr = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._lock = threading.Lock()
        self._seq = 0
        self._last: EngineSnapshot | None = None
        self._last_sent = time.monotonic()
        self.sent = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._idle_loop, name="kairos-state-idle", daemon=True)
        self._thread.start()

    def publish(self, snap: EngineSnapshot) -> None:
        """Stamp ``seq``/``sent_unix_ms``/``engine_pid`` on ``snap`` and send it without blocking."""
        with self._lock:
            self._send_locked(snap)

    def _send_locked(self, snap: EngineSnapshot) -> None:
        if self._sock.closed:
            return
        self._seq += 1
        snap = msgspec.structs.replace(snap, seq=self._seq, sent_unix_ms=time.time() * 1000.0, engine_pid=os.getpid())
        try:
            self._sock.send(encode(snap), zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            self.dropped += 1
        self._last = msgspec.structs.replace(snap, step_record=None) if snap.step_record is not None else snap
        self._last_sent = time.monotonic()

    def _idle_loop(self) -> None:
        while True:
            with self._lock:
                due = self._last_sent + self.idle_period_s - time.monotonic()
                if due <= 0:
                    if self._last is not None:
                        self._send_locked(self._last)
                    due = self.idle_period_s
            if self._stop.wait(max(due, 0.001)):
                return

    def close(self) -> None:
        """Stop the idle thread and close the socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        with self._lock:
            if not self._sock.closed:
                self._sock.close(linger=0)
                self._ctx.term()
