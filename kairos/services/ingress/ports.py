"""What the ingress's request logic needs from the message bus, as one small protocol.

The relay of a request (:mod:`.relay`), the watchers of in-flight requests (:mod:`.liveness`), the
timing records and the records endpoint (:mod:`.records`) reach NATS only through
:class:`IngressBus`. The service (:mod:`.service`) hands them :class:`~.nats_bus.NatsIngressBus`
(requests to the dispatchers' queue group, jobs to the nodes, core-NATS cancels, the requests bucket); a unit test
hands them a fake that records what was sent (tests/unit/test_ingress_relay.py), so their protocol
logic runs without a nats-server. Their clocks come the same way (:class:`kairos.runtime.clock.Clock`).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol, TypeVar


T = TypeVar("T")


class OutSubscription(Protocol):
    """A subscription to one attempt's out events (``kairos.out.<attempt id>.*``)."""

    async def unsubscribe(self) -> None:
        """Stop it (a failure is the bus adapter's to log, never raised)."""


class NoDispatcher(Exception):
    """No dispatcher took the request in time (none answered ``taken``, or none subscribes): the
    message bus itself answered. The message says how long it was tried."""


class EnqueueAbandoned(Exception):
    """An enqueue gave up because nobody waits for the request any more (its client left, the
    ingress is closing); the request may still reach a dispatcher: cancel it."""


class NoAgent(Exception):
    """A job found no agent subscribed to its node's job subject (it never reached the node)."""


class NodeSilent(Exception):
    """A node did not answer a job in time: the job, or its answer, may have been lost with a NATS
    member, or the node is frozen — it may run the job."""


class IngressBus(Protocol):
    """The bus operations of the ingress's request logic (units: s, ms since the epoch for ``*_unix_ms``).

    Raises: only where a method says so; every other failure is logged by the implementation.
    """

    @property
    def max_payload(self) -> int:
        """The largest message the bus carries, bytes (NATS ``max_payload``; 0: unknown, no limit)."""

    def disconnected_since(self) -> float | None:
        """``time.monotonic()`` when the connection was lost, None while connected."""

    async def enqueue(self, body: bytes, headers: dict[str, str], first_delivery: int = 1,
                      give_up: Callable[[], bool] | None = None) -> int:
        """Send one attempt (an encoded :class:`~kairos.contracts.wire.InferenceRequest`) to the
        dispatchers until one takes it, or ``give_up()``; the copies are numbered from
        ``first_delivery``; returns how many were sent (kairos/services/ingress/nats_bus.py).

        Raises:
            EnqueueAbandoned: ``give_up()`` was true before a try.
            Exception: no dispatcher took it in time (the caller answers 503 ``enqueue_failed``).
        """

    def notice_subject(self, attempt_id: str) -> str:
        """The subject the dispatcher routing ``attempt_id`` sends its ``alive`` notices to."""

    async def send_job(self, node: str, job: bytes, headers: dict[str, str] | None) -> bytes:
        """Send an encoded :class:`~kairos.contracts.wire.Job` to ``node`` (core NATS request-reply on
        ``kairos.jobs.<node>``) and return its answer's bytes (a :class:`~kairos.contracts.wire.JobAck`).

        Raises:
            NoAgent: nobody subscribes to the node's job subject.
            NodeSilent: no answer within the job timeout, or the connection is down.
        """

    async def respond(self, reply: str, data: bytes) -> None:
        """Answer a dispatcher's job on its reply subject (never raises: a lost answer costs the
        dispatcher its wait, after which it stops routing the attempt)."""

    async def ping_dispatchers(self) -> str | None:
        """Ping the dispatchers once: None when one answered, else why not."""

    async def subscribe_out(self, attempt_id: str, cb: Callable[[Any], Awaitable[None]]) -> OutSubscription:
        """Deliver the out events of ``attempt_id`` to ``cb`` (a message with ``subject``, ``data``,
        ``headers``), for an ingress without the one ``kairos.out.*.*`` subscription."""

    async def cancel(self, attempt_id: str, reason: str) -> None:
        """Tell every node to stop ``attempt_id`` (core NATS, ``kairos.cancel``); never raises."""

    async def drain(self, node: str, reason: str) -> None:
        """Ask ``node`` to drain (core NATS, ``kairos.drain.<node>``: issue 33).

        Raises:
            Exception: the connection did not take it.
        """

    async def read_record(self, key: str, typ: type[T]) -> T | None:
        """The record under ``key`` of the requests bucket decoded as ``typ``; None when absent or
        not decodable.

        Raises:
            Exception: the bucket did not answer.
        """

    async def recent_records(self, part: str, since_unix_ms: float, limit: int) -> tuple[dict[str, bytes], bool]:
        """Key → value of the requests bucket's ``<rid>.<part>`` records written since ``since_unix_ms``
        (the last write of each key; deleted keys left out), at most ``limit`` writes read, and whether
        the read stopped there with writes still to come (the window's newest then missing).

        Raises:
            Exception: the bucket did not answer (or a record took over 5 s to come).
        """

    async def write_record(self, key: str, data: bytes) -> None:
        """Store a record in the requests bucket without waiting for an acknowledgement.

        Raises:
            Exception: the connection did not take it.
        """
