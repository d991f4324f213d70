"""Small NATS helpers: connect, declare the streams/consumers/KV buckets, typed request-reply.

Every declaration is idempotent (same config → the existing object), so each service declares
what it uses at start and services can start in any order. Names come from :mod:`shared.subjects`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (AckPolicy, ConsumerConfig, DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType,
                         StreamConfig)
from nats.js.kv import KeyValue

from shared import subjects as S
from shared.wire import decode, encode

T = TypeVar("T")


async def connect(url: str, name: str, log=None) -> Client:
    """Connect with reconnects forever (a restarted nats-server is picked up again).

    The first connection is retried forever too (every 0.5 s, each failure logged as
    ``nats_error``), so services may start before NATS. This never gives up on its own: to abort
    it (a signal during startup), cancel the awaiting task — ``services.common.run_main`` does.
    """

    async def on_error(exc: Exception) -> None:
        if log is not None:
            log.warning("nats_error", error=repr(exc))

    async def on_disconnect() -> None:
        if log is not None:
            log.info("nats_disconnected")

    async def on_reconnect() -> None:
        if log is not None:
            log.info("nats_reconnected")

    return await nats.connect(url, name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                              error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
                              connect_timeout=5, drain_timeout=2)


async def close(nc: Client | None, graceful: bool = True) -> None:
    """Flush what is buffered (``graceful``) and close; never raises, never hangs for long."""
    if nc is None or nc.is_closed:
        return
    if graceful and nc.is_connected:
        try:
            await nc.flush(timeout=1)
        except Exception:
            pass
    try:
        await nc.close()
    except Exception:
        pass


@dataclass(frozen=True)
class RequestQueueSettings:
    """The work-queue consumer's redelivery behaviour.

    Attributes:
        ack_wait_s: a dispatcher that neither acks nor reports progress for this long is presumed
            dead; the request is redelivered to another replica.
        max_deliver: deliveries before a request is given up (the ingress then times out → 504).
        max_age_s: requests older than this are dropped from the stream (their ingress deadline has
            passed long ago).
    """

    ack_wait_s: float = 5.0
    max_deliver: int = 5
    max_age_s: float = 600.0


async def ensure_request_stream(js: JetStreamContext, q: RequestQueueSettings = RequestQueueSettings()) -> None:
    """Declare the work-queue stream KAIROS_REQ and the shared durable consumer."""
    await js.add_stream(StreamConfig(
        name=S.REQUEST_STREAM, subjects=[S.REQUEST_SUBJECT], retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE, discard=DiscardPolicy.OLD, max_age=q.max_age_s, duplicate_window=120.0,
        description="Kairos client requests: ingress -> dispatchers (work queue)"))
    await js.add_consumer(S.REQUEST_STREAM, ConsumerConfig(
        durable_name=S.DISPATCHER_CONSUMER, name=S.DISPATCHER_CONSUMER, ack_policy=AckPolicy.EXPLICIT,
        ack_wait=q.ack_wait_s, max_deliver=q.max_deliver, filter_subject=S.REQUEST_SUBJECT,
        max_ack_pending=10_000, description="all dispatcher replicas pull from this one consumer"))


async def request_subscription(js: JetStreamContext) -> JetStreamContext.PullSubscription:
    """Bind to the shared dispatcher consumer (declare it first with :func:`ensure_request_stream`)."""
    return await js.pull_subscribe_bind(durable=S.DISPATCHER_CONSUMER, stream=S.REQUEST_STREAM)


@dataclass(frozen=True)
class Buckets:
    view: KeyValue
    reservations: KeyValue
    requests: KeyValue


async def ensure_buckets(js: JetStreamContext, records_ttl_s: float = 3600.0) -> Buckets:
    """Declare (or open) the three KV buckets."""
    view = await js.create_key_value(KeyValueConfig(
        bucket=S.VIEW_BUCKET, history=1, storage=StorageType.MEMORY,
        description="cluster view written by the state aggregator"))
    resv = await js.create_key_value(KeyValueConfig(
        bucket=S.RESERVATION_BUCKET, history=1, storage=StorageType.MEMORY, limit_marker_ttl=1.0,
        description="one deflection slot per decode node (atomic create, per-message TTL)"))
    reqs = await js.create_key_value(KeyValueConfig(
        bucket=S.REQUESTS_BUCKET, history=1, storage=StorageType.FILE, ttl=records_ttl_s,
        description="per-request decision records and measured TTFT components"))
    return Buckets(view=view, reservations=resv, requests=reqs)


async def ensure_models_bucket(js: JetStreamContext) -> KeyValue:
    """Declare (or open) the latency-model bucket (``kairos profile`` writes, dispatchers watch).

    File storage with a short history, so the previous artifacts of a key can be inspected.
    """
    return await js.create_key_value(KeyValueConfig(
        bucket=S.MODELS_BUCKET, history=5, storage=StorageType.FILE,
        description="latency-model artifacts: latency.<name> and latency.current"))


async def request_typed(nc: Client, subject: str, msg: msgspec.Struct, reply_type: type[T], timeout: float,
                        headers: dict[str, str] | None = None) -> T:
    """Request-reply with typed bodies.

    Raises:
        nats.errors.NoRespondersError: nobody subscribes to ``subject`` (node gone).
        nats.errors.TimeoutError: no reply within ``timeout`` s (node hung or overloaded).
        shared.wire.WireError: the reply does not decode.
    """
    reply = await nc.request(subject, encode(msg), timeout=timeout, headers=headers)
    return decode(reply.data, reply_type)


async def publish(nc: Client, subject: str, msg: msgspec.Struct, headers: dict[str, str] | None = None) -> None:
    """Core-NATS publish of a typed message."""
    await nc.publish(subject, encode(msg), headers=headers)
