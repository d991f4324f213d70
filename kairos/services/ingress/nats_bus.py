"""The ingress's bus operations on NATS: :class:`~.ports.IngressBus` over one connection.

* **enqueue**: an attempt is published to a request lane (``kairos.req.new.<lane>``, one JetStream
  stream per NATS member, kairos/runtime/lanes.py) and acknowledged by JetStream; lanes are tried in
  turn, a lane that does not answer is marked down and the next one tried with the same
  ``Nats-Msg-Id``; while the connection is down (a failover to another member) the enqueue waits
  for it, at most :data:`RECONNECT_WAIT_S` of outage;
* **cancel**: core NATS ``kairos.cancel`` to every node;
* **tombstones**: an attempt answered with an error before any node took it gets its tombstone
  claim (kairos/runtime/claims.py ``withdraw``), so no node runs it later;
* **records**: the requests bucket (``kairos_requests``), read with a get, written without an
  acknowledgement (:func:`kairos.runtime.bus.kv_put_nowait`); the claim buckets, read by a quorum.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

import nats.errors
import nats.js.errors

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.events import Cancel, Drain
from kairos.contracts.wire import Claim, decode, WireError
from kairos.runtime.buswatch import BusWatch
from kairos.runtime.claims import ClaimQuorum, read_holder, withdraw
from kairos.runtime.clock import Clock
from kairos.runtime.lanes import LanePicker
from kairos.runtime.messaging import kv_put_nowait, publish
from kairos.services.ingress.metrics import IngressMetrics

T = TypeVar("T")

#: with several request lanes, a publish to one waits this long (s) for JetStream's acknowledgement
#: before the next lane is tried (the acknowledgement takes milliseconds while the lane's member lives)
LANE_PUBLISH_TIMEOUT_S = 1.0
#: an enqueue waits this long (s) for a lost connection to come back (a failover to another member
#: of a NATS cluster takes milliseconds); a longer outage answers 503 ``enqueue_failed`` at once
RECONNECT_WAIT_S = 2.0
#: after a publish got no acknowledgement, the one server (a single-member deployment) must answer a
#: PING within this long (s), else it is frozen or cut off (not a slow JetStream under load, which still answers pings at once) and the
#: enqueue gives up while the connection is still open: the cancel and the tombstone claim of the
#: attempt then follow its publish on the same connection, so the server stores them right after it
#: whenever it resumes, before any node can claim it. Well below nats-py's ping-out
#: (kairos/runtime/bus.py PING_INTERVAL_S × MAX_OUTSTANDING_PINGS, 6 s), after which the connection
#: is dropped, the two would go out on a new connection, and a node could claim the stored request first
UNRESPONSIVE_PONG_S = 1.0
#: how long that PING's waiter stays in nats-py's queue (s): far past the ping-out, so the connection
#: is gone (its waiters with it) before this could cancel one whose PONG is still to come
PONG_LATE_S = 3600.0
#: what a lane that does not take a publish raises (no stream: its member is down; no acknowledgement)
LANE_ERRORS = (nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
               nats.js.errors.ServiceUnavailableError)


class _OutSub:
    """One attempt's out-event subscription; a failed unsubscribe is logged."""

    def __init__(self, sub: Any, log: Any) -> None:
        self.sub, self.log = sub, log

    async def unsubscribe(self) -> None:
        try:
            await self.sub.unsubscribe()
        except nats.errors.Error as exc:  # already gone with its connection: nothing left to stop
            self.log.info("out_unsubscribe_failed", subject=self.sub.subject, error=repr(exc))


class NatsIngressBus:
    """:class:`~.ports.IngressBus` on a NATS connection (module docstring).

    Args:
        nc: the connected client; ``js`` its JetStream context.
        lanes: the request lanes' picker (which to try, which are down).
        claims: the claim buckets (None: read as no claim, no tombstone written).
        watch: the connection's :class:`BusWatch` (when the connection was lost).
        enqueue_timeout_s: how long an enqueue keeps trying (``KAIROS_ENQUEUE_TIMEOUT_S``).
        metrics, clock, log: the ingress's metrics (enqueue retries), clocks and logger.
    """

    def __init__(self, nc: Any, js: Any, lanes: LanePicker, claims: ClaimQuorum | None, watch: BusWatch | None,
                 enqueue_timeout_s: float, metrics: IngressMetrics, clock: Clock, log: Any) -> None:
        self.nc, self.js, self.lanes, self.claims, self.watch = nc, js, lanes, claims, watch
        self.enqueue_timeout_s, self.m, self.clock, self.log = enqueue_timeout_s, metrics, clock, log
        self.requests: Any = None  #: the requests bucket (set at every declare: start and reconnects)

    @property
    def max_payload(self) -> int:
        return getattr(self.nc, "max_payload", 0) or 0

    def disconnected_since(self) -> float | None:
        return self.watch.disconnected_since if self.watch is not None else None

    async def enqueue(self, body: bytes, headers: dict[str, str]) -> int:
        """Publish one request to a request lane (kairos/runtime/lanes.py), acknowledged by JetStream;
        returns the lane. Lanes are tried in turn (:meth:`LanePicker.order`); one that finds no
        stream (its member is down: no responders) or gives no acknowledgement within
        :data:`LANE_PUBLISH_TIMEOUT_S` (2 s with a single lane) is marked down and the next is
        tried at once, with the same ``Nats-Msg-Id`` (a lane keeps one copy within its 120 s
        duplicate window; copies on two lanes meet one execution claim). With every lane failing
        it starts over every 0.1 s until ``enqueue_timeout_s`` has passed; while the
        connection is down (nats-py reconnecting to another member) it waits for it, polling every
        50 ms — an outage older than :data:`RECONNECT_WAIT_S` is not a failover: that raises at once.
        With a single server, a publish that timed out on a server that does not answer a PING
        either (:data:`UNRESPONSIVE_PONG_S`: frozen, not merely slow) raises at once, on the open
        connection. With several members it does not: the member may be frozen or swamped for a
        moment (an unanswered PING is also what an ingress whose own event loop was starved sees),
        and the request goes on to the next lane, and to another member once nats-py fails the
        connection over (issue 32: a member frozen for 3 s, or a loaded machine, had requests
        answered ``enqueue_failed`` while two members were up; 21 of 242 in the frozen case).
        Then the last error is raised (the caller answers 503 ``enqueue_failed``); a closed
        connection raises at once.

        Raises:
            ConnectionError: not connected to NATS when the time was up.
            nats.errors.TimeoutError, nats.errors.NoRespondersError, nats.js.errors.Error: the
                last try's error.
        """
        mono = self.clock.monotonic
        deadline = mono() + self.enqueue_timeout_s
        per_try = LANE_PUBLISH_TIMEOUT_S if self.lanes.lanes > 1 else 2.0
        while True:
            while not self.nc.is_connected and not self.nc.is_closed and mono() < deadline:
                since = self.disconnected_since()
                if since is not None and mono() - since > RECONNECT_WAIT_S:
                    break
                await self.clock.sleep(0.05)
            if not self.nc.is_connected:
                raise ConnectionError("the ingress is not connected to NATS")
            for lane in self.lanes.order(mono()):
                try:
                    await self.js.publish(S.request_subject(lane), body, headers=headers, stream=S.request_stream(lane),
                                          timeout=min(per_try, max(0.1, deadline - mono())))
                    return lane
                except LANE_ERRORS as exc:
                    self.lanes.down(lane, mono())
                    if self.nc.is_closed or mono() + 0.1 >= deadline:
                        raise
                    if (self.lanes.lanes == 1 and isinstance(exc, nats.errors.TimeoutError)
                            and not await self._answers_ping()):
                        raise  # the one server is frozen: give up while the connection is open
                    self.m.enqueue_retries.inc()
            await self.clock.sleep(0.1)

    async def _answers_ping(self) -> bool:
        """Whether the server answers a PING within :data:`UNRESPONSIVE_PONG_S`.

        The PING's wait is not cut short: nats-py matches PONGs to its waiters in order, and one whose
        waiter was cancelled (``flush(timeout=…)`` timing out) would break its read loop when the late
        PONG comes (``set_result`` on a cancelled future). The flush waits on in the background
        (:data:`PONG_LATE_S`) and only this check gives up on it."""
        answered = asyncio.Event()
        ping = asyncio.ensure_future(self.nc.flush(timeout=PONG_LATE_S))
        ping.add_done_callback(lambda f: (f.cancelled() or f.exception(), answered.set()))  # outcome read here or never
        if not await self.clock.wait_event(answered, UNRESPONSIVE_PONG_S):
            return False
        return ping.cancelled() or not isinstance(ping.exception(), nats.errors.TimeoutError)

    async def publish_on_lane(self, lane: int, body: bytes, headers: dict[str, str]) -> None:
        await self.js.publish(S.request_subject(lane), body, headers=headers, stream=S.request_stream(lane),
                              timeout=LANE_PUBLISH_TIMEOUT_S)

    async def subscribe_out(self, attempt_id: str, cb: Callable[[Any], Awaitable[None]]) -> _OutSub:
        return _OutSub(await self.nc.subscribe(S.out_wildcard(attempt_id), cb=cb), self.log)

    async def cancel(self, attempt_id: str, reason: str) -> None:
        try:
            await publish(self.nc, S.CANCEL_SUBJECT, Cancel(request_id=attempt_id, reason=reason))
        except nats.errors.Error as exc:  # the connection is gone: the nodes' deadlines end the attempt
            self.log.warning("cancel_publish_failed", request_id=attempt_id, reason=reason, error=repr(exc))

    async def drain(self, node: str, reason: str) -> None:
        await publish(self.nc, S.drain_subject(node), Drain(node=node, reason=reason, sent_unix_ms=self.clock.now_ms()))
        await self.nc.flush(timeout=2.0)  # the operator's answer says it went out

    async def withdraw(self, attempt_id: str, code: ErrorCode, deadline_unix_ms: float) -> None:
        if self.claims is None:
            return
        outcome, claim = await withdraw(self.claims, attempt_id, code, deadline_unix_ms)
        if outcome == "withdrawn":
            self.log.info("attempt_withdrawn", request_id=attempt_id, code=code)
        elif outcome == "ran":
            self.log.warning("withdrawn_attempt_ran", request_id=attempt_id, code=code,
                             node=claim.node if claim else None)
        else:
            self.log.warning("attempt_withdrawal_expired", request_id=attempt_id, code=code)

    async def read_record(self, key: str, typ: type[T]) -> T | None:
        try:
            e = await self.requests.get(key)
            return decode(e.value, typ) if e is not None and e.value else None
        except (nats.js.errors.KeyNotFoundError, WireError):
            return None

    async def read_claim(self, attempt_id: str) -> Claim | None:
        return await read_holder(self.claims, attempt_id) if self.claims is not None else None

    async def write_record(self, key: str, data: bytes) -> None:
        await kv_put_nowait(self.nc, S.REQUESTS_BUCKET, key, data)
