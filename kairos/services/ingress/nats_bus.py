"""The ingress's bus operations on NATS: :class:`~.ports.IngressBus` over one connection.

* **enqueue**: an attempt is sent to the dispatchers' queue group (core NATS request-reply on
  ``kairos.req.route``, kairos/services/dispatcher/intake.py) and counts as taken once a replica
  answers ``taken``; no answer in :data:`TAKEN_TIMEOUT_S` sends it again at once (same bus id: the
  attempt's arbiter keeps copies to one run, kairos/services/ingress/jobrelay.py), no dispatcher at all is retried every
  :data:`NO_DISPATCHER_RETRY_S`; while the connection is down (a failover to another member) the
  enqueue waits for it, at most :data:`RECONNECT_WAIT_S` of outage. Nothing is stored on the way;
* **ping**: one ping of the queue group (``/health``);
* **jobs**: a job the attempt's arbiter let go, to its node (core NATS request-reply on
  ``kairos.jobs.<node>``), and the node's answer back to the dispatcher that planned it;
* **cancel**: core NATS ``kairos.cancel`` to every node;
* **records**: the requests bucket (``kairos_requests``), read with a get (one record) or an ordered
  consumer from a start time (a window's, ``GET /v1/admin/workload``), written without an
  acknowledgement (:func:`kairos.runtime.bus.kv_put_nowait`).
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any, Awaitable, Callable, TypeVar

import nats.errors
import nats.js.errors
from nats.js.api import ConsumerConfig, DeliverPolicy

from kairos.contracts import subjects as S
from kairos.contracts.events import Cancel, Drain
from kairos.contracts.permissions import kv_stream
from kairos.contracts.wire import decode, WireError
from kairos.runtime.buswatch import BusWatch
from kairos.runtime.clock import Clock
from kairos.runtime.messaging import kv_put_nowait, kv_subject, publish
from kairos.services.ingress.metrics import IngressMetrics
from kairos.services.ingress.ports import EnqueueAbandoned, NoAgent, NoDispatcher, NodeSilent

T = TypeVar("T")

#: how long a replica has to answer ``taken`` (s) before the request is sent again (a replica answers
#: within milliseconds while its process and member live)
TAKEN_TIMEOUT_S = 0.5
#: with no dispatcher subscribed (none started yet, or all restarting), the next try after this (s)
NO_DISPATCHER_RETRY_S = 0.1
#: the longest wait (s) for the next record of a window read from the requests bucket
RECORDS_READ_TIMEOUT_S = 5.0
#: how long a ping of the dispatchers waits for an answer (s)
PING_TIMEOUT_S = 1.0
#: an enqueue waits this long (s) for a lost connection to come back (a failover to another member
#: of a NATS cluster takes milliseconds); a longer outage answers 503 ``enqueue_failed`` at once
RECONNECT_WAIT_S = 2.0
#: after a request got no ``taken``, the one server (a single-member deployment) must answer a PING
#: within this long (s), else it is frozen or cut off (not busy dispatchers: the server itself still
#: answers pings at once) and the enqueue gives up at once: the client gets its 503 now rather than
#: after ``enqueue_timeout_s``, and the attempt's cancel follows its copies on the same connection
UNRESPONSIVE_PONG_S = 1.0
#: how long that PING's waiter stays in nats-py's queue (s): far past the ping-out, so the connection
#: is gone (its waiters with it) before this could cancel one whose PONG is still to come
PONG_LATE_S = 3600.0
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
        nc: the connected client.
        members: NATS servers of the deployment (1: a single server, whose freeze ends an enqueue at once).
        watch: the connection's :class:`BusWatch` (when the connection was lost).
        enqueue_timeout_s: how long an enqueue keeps trying (``KAIROS_ENQUEUE_TIMEOUT_S``).
        metrics, clock, log: the ingress's metrics (enqueue retries), clocks and logger.
        job_ack_timeout_s: how long a node has to answer a job (``KAIROS_JOB_ACK_TIMEOUT_S``).
    """

    def __init__(self, nc: Any, members: int, watch: BusWatch | None, enqueue_timeout_s: float,
                 metrics: IngressMetrics, clock: Clock, log: Any, job_ack_timeout_s: float = 1.0) -> None:
        self.nc, self.members, self.watch = nc, members, watch
        self.enqueue_timeout_s, self.m, self.clock, self.log = enqueue_timeout_s, metrics, clock, log
        self.job_ack_timeout_s = job_ack_timeout_s
        self.requests: Any = None  #: the requests bucket (set at every declare: start and reconnects)
        self.notices = ""  #: the prefix of the attempts' notice subjects (:meth:`notice_subject`; set at start)

    @property
    def max_payload(self) -> int:
        return getattr(self.nc, "max_payload", 0) or 0

    def disconnected_since(self) -> float | None:
        return self.watch.disconnected_since if self.watch is not None else None

    def notice_subject(self, attempt_id: str) -> str:
        """Where the dispatcher routing ``attempt_id`` sends its ``alive`` notices (one wildcard
        subscription of this ingress, :attr:`notices` ``.*``)."""
        return f"{self.notices}.{attempt_id}"

    async def enqueue(self, body: bytes, headers: dict[str, str], first_delivery: int = 1,
                      give_up: Callable[[], bool] | None = None) -> int:
        """Send one request to the dispatchers' queue group until a replica answers ``taken``
        (module docstring); returns how many copies it sent. Each copy carries its number
        (``Kairos-Delivery``, counting on from ``first_delivery``) and its send time
        (``Kairos-Sent-Unix-Ms``: a dispatcher drops a copy it gets too late, another one is out).
        No answer within :data:`TAKEN_TIMEOUT_S` sends it again at once (the same bus id: the attempt's arbiter keeps copies to one run); no dispatcher
        subscribed is tried again every :data:`NO_DISPATCHER_RETRY_S`, until ``enqueue_timeout_s``.
        While the connection is down (nats-py reconnecting to another member) it waits for it,
        polling every 50 ms — an outage older than :data:`RECONNECT_WAIT_S` is not a failover: that
        raises at once. With a single server, a request that timed out on a server that does not
        answer a PING either (:data:`UNRESPONSIVE_PONG_S`: frozen, not merely slow) raises at once,
        on the open connection. With several members it does not: the member may be frozen or
        swamped for a moment (issue 32), and the request goes to another member once nats-py fails
        the connection over. Then the last error is raised (the caller answers 503
        ``enqueue_failed``); a closed connection raises at once. ``give_up()`` true before a try
        (the client left, the ingress closes) ends it too.

        Raises:
            EnqueueAbandoned: ``give_up()`` said so.
            NoDispatcher: no dispatcher took it within ``enqueue_timeout_s``.
            ConnectionError: not connected to NATS when the time was up.
            nats.errors.TimeoutError: the one server is frozen (no PONG).
        """
        mono = self.clock.monotonic
        deadline = mono() + self.enqueue_timeout_s
        sends = 0
        while True:
            if give_up is not None and give_up():
                raise EnqueueAbandoned("nobody waits for the request any more")
            while not self.nc.is_connected and not self.nc.is_closed and mono() < deadline:
                since = self.disconnected_since()
                if since is not None and mono() - since > RECONNECT_WAIT_S:
                    break
                await self.clock.sleep(0.05)
            if not self.nc.is_connected:
                raise ConnectionError("the ingress is not connected to NATS")
            sends += 1
            try:
                await self.nc.request(S.ROUTE_SUBJECT, body, timeout=min(TAKEN_TIMEOUT_S, max(0.05, deadline - mono())),
                                      headers={**headers, S.DELIVERY_HEADER: str(first_delivery + sends - 1),
                                               S.SENT_HEADER: f"{self.clock.now_ms():.0f}"})
                return sends
            except nats.errors.NoRespondersError as exc:
                if self.nc.is_closed:
                    raise
                if mono() + NO_DISPATCHER_RETRY_S >= deadline:
                    raise NoDispatcher(f"no dispatcher subscribes (tried for {self.enqueue_timeout_s:g} s)") from exc
                await self.clock.sleep(NO_DISPATCHER_RETRY_S)
            except nats.errors.TimeoutError as exc:
                if self.nc.is_closed:
                    raise
                if mono() + 0.05 >= deadline:
                    raise NoDispatcher(f"no dispatcher took it within {self.enqueue_timeout_s:g} s") from exc
                if self.members == 1 and not await self._answers_ping():
                    raise  # the one server is frozen: give up while the connection is open
            self.m.enqueue_retries.inc()

    async def send_job(self, node: str, job: bytes, headers: dict[str, str] | None) -> bytes:
        if not self.nc.is_connected:  # nats-py would buffer it: whether it reaches the node is unknown
            raise NodeSilent("the ingress is not connected to NATS")
        try:
            reply = await self.nc.request(S.jobs_subject(node), job, timeout=self.job_ack_timeout_s, headers=headers)
        except nats.errors.NoRespondersError as exc:
            raise NoAgent(str(exc)) from exc
        except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.ConnectionClosedError) as exc:
            raise NodeSilent(repr(exc)) from exc
        return reply.data

    async def respond(self, reply: str, data: bytes) -> None:
        try:
            await self.nc.publish(reply, data)
        except nats.errors.Error as exc:  # disconnected: the dispatcher's wait ends its routing
            self.log.info("job_answer_not_relayed", error=repr(exc))

    async def ping_dispatchers(self) -> str | None:
        """Ping the dispatchers' queue group once: None when a replica answered, else why not."""
        if not self.nc.is_connected:
            return "disconnected"
        try:
            await self.nc.request(S.ROUTE_SUBJECT, b"", headers={S.PING_HEADER: "1"}, timeout=PING_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            return "no_responders"
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            return "timeout"
        except nats.errors.Error as exc:  # disconnected meanwhile
            return repr(exc)
        return None

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

    async def read_record(self, key: str, typ: type[T]) -> T | None:
        try:
            e = await self.requests.get(key)
            return decode(e.value, typ) if e is not None and e.value else None
        except (nats.js.errors.KeyNotFoundError, WireError):
            return None

    async def write_record(self, key: str, data: bytes) -> None:
        await kv_put_nowait(self.nc, S.REQUESTS_BUCKET, key, data)

    async def recent_records(self, part: str, since_unix_ms: float, limit: int) -> tuple[dict[str, bytes], bool]:
        # an ordered consumer of the part's keys from a start time: only the window's writes cross the bus
        start = datetime.datetime.fromtimestamp(since_unix_ms / 1000.0, tz=datetime.timezone.utc)
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start.isoformat(),
                             headers_only=False)
        # the stream named: else nats-py asks $JS.API.STREAM.NAMES, which no role may
        sub = await self.nc.jetstream().subscribe(kv_subject(S.REQUESTS_BUCKET, f"*.{part}"), ordered_consumer=True,
                                                  stream=kv_stream(S.REQUESTS_BUCKET), config=cfg)
        out: dict[str, bytes] = {}
        try:
            info = await sub.consumer_info()  # nothing to deliver and nothing delivered yet: an empty window
            if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
                return out, False
            for _ in range(limit):
                msg = await sub.next_msg(timeout=RECORDS_READ_TIMEOUT_S)
                key = msg.subject[len(kv_subject(S.REQUESTS_BUCKET, "")):]
                if msg.data:
                    out[key] = msg.data  # a later write of the key (a migrated request's record) replaces it
                else:
                    out.pop(key, None)  # a delete marker
                if msg.metadata.num_pending == 0:
                    return out, False
        finally:
            await sub.unsubscribe()
        return out, True  # limit writes read, more were pending
