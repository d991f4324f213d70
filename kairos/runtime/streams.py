"""Stream, consumer and KV bucket declarations every service makes at start (and after a reconnect).

Every declaration is idempotent (same configuration → the existing object), so each service declares
what it uses at start and services can start in any order; names come from
:mod:`kairos.contracts.subjects`. Every stream and bucket is file-backed, so a server restarted on
the same store keeps them (reservations, records, the last view); a server that
comes back with an empty store is repopulated by the services' re-declares
(:class:`kairos.runtime.buswatch.BusWatch`). Replica counts: :func:`kairos.runtime.bus.stream_replicas`.

A stream that exists with another configuration is a :class:`StreamConfigMismatch` naming the
settings the services disagree on.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from kairos.contracts import subjects as S
from kairos.contracts.permissions import kv_stream
from kairos.runtime.envconfig import ConfigError

T = TypeVar("T")


#: nats-server's generic "error creating store for stream" (JSStreamCreateErrF): seen when a file
#: stream is created while the store directory of a just-deleted stream of that name is still being
#: removed, or by two services declaring it at the same instant
_STORE_CREATE_ERR = 10049
#: nats-server's "stream name already in use with a different configuration" (JSStreamNameExistErr)
_IN_USE_ERR = 10058


class StreamConfigMismatch(ConfigError):
    """A stream or KV bucket exists with another configuration than this service declares it with
    (nats-server's "stream name already in use with a different configuration"): the services of
    one deployment disagree on ``KAIROS_NATS_REPLICAS`` / the server URL
    list, or the store holds an older Kairos's layout. The message says which and what to do."""


async def creating(declare: Callable[[], Awaitable[T]], attempts: int = 20, wait_s: float = 0.1,
                   what: str = "a stream") -> T:
    """``declare()``, retried (``attempts`` × ``wait_s``) on the transient store-creation error.

    Raises:
        StreamConfigMismatch: ``what`` exists with another configuration.
    """
    for i in range(attempts):
        try:
            return await declare()
        except nats.js.errors.APIError as exc:
            code = getattr(exc, "err_code", None)
            if code == _IN_USE_ERR:
                raise StreamConfigMismatch(
                    f"{what} exists on the NATS server with another configuration than this service declares "
                    f"(replicas or placement): every service of a deployment needs the same KAIROS_NATS_URL "
                    f"member list and KAIROS_NATS_REPLICAS (docs/deploy.md); or remove the "
                    f"old stream if an older deployment left it ({exc.description})") from exc
            if code != _STORE_CREATE_ERR or i == attempts - 1:
                raise
            await asyncio.sleep(wait_s)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Buckets:
    view: KeyValue
    reservations: KeyValue
    requests: KeyValue


async def _declare_kv(js: JetStreamContext, config: KeyValueConfig, replicas: int | None) -> KeyValue:
    """Create KV bucket ``config`` with ``replicas`` replicas (the existing one if its config is the
    same); ``replicas`` None: open the bucket if it exists whatever its replicas (a client that does
    not know the deployment's replica count, e.g. ``kairos profile``), else create it with 1."""
    if replicas is None:
        try:
            return await js.key_value(config.bucket)
        except nats.js.errors.BucketNotFoundError:
            replicas = 1
    cfg = dataclasses.replace(config, replicas=replicas)
    return await creating(lambda: js.create_key_value(cfg), what=f"KV bucket {config.bucket!r} ({replicas} replicas)")


async def ensure_buckets(js: JetStreamContext, records_ttl_s: float = 3600.0, replicas: int | None = 1) -> Buckets:
    """Declare (or open) the three KV buckets, all file-backed so a restarted nats-server keeps
    them (the view and reservations used to be memory-backed and vanished on a restart), each with
    ``replicas`` replicas (:func:`stream_replicas`; None: :func:`_declare_kv`).

    Raises:
        BucketLayoutError: the server holds a ``kairos_requests`` bucket of the layout before direct
            gets (the message says what to do). Other JetStream errors propagate (nats-py ``APIError``).
    """
    view = await _declare_kv(js, KeyValueConfig(
        bucket=S.VIEW_BUCKET, history=1, storage=StorageType.FILE,
        description="cluster view written by the state aggregator"), replicas)
    resv = await _declare_kv(js, KeyValueConfig(
        bucket=S.RESERVATION_BUCKET, history=1, storage=StorageType.FILE, limit_marker_ttl=1.0,
        description="one deflection slot per decode node (atomic create, per-message TTL)"), replicas)
    # direct gets: a get names its key in the subject, so a read permission can name keys (the ingress's record reads)
    try:
        reqs = await _declare_kv(js, KeyValueConfig(
            bucket=S.REQUESTS_BUCKET, history=1, storage=StorageType.FILE, ttl=records_ttl_s, direct=True,
            description="per-request decision records and measured TTFT components"), replicas)
    except StreamConfigMismatch as exc:
        if not (await js.stream_info(kv_stream(S.REQUESTS_BUCKET))).config.allow_direct:
            raise BucketLayoutError(
                f"the KV bucket {S.REQUESTS_BUCKET!r} (stream {kv_stream(S.REQUESTS_BUCKET)}) has an older layout without "
                f"direct gets, which the ingress's record reads use (docs/security.md); delete it "
                f"(nats kv del {S.REQUESTS_BUCKET}, or remove the nats-server's JetStream store) and start "
                f"again: it holds only the last hour's request records") from exc
        raise
    return Buckets(view=view, reservations=resv, requests=reqs)


class BucketLayoutError(ConfigError):
    """A KV bucket in the server's store was created by an older Kairos with a layout this one
    cannot use (:func:`ensure_buckets`); the message names the bucket and what to do."""


async def ensure_models_bucket(js: JetStreamContext, replicas: int | None = 1) -> KeyValue:
    """Declare (or open) the latency-model bucket (``kairos profile`` writes, dispatchers watch),
    with ``replicas`` replicas (None: open it whatever its replicas, :func:`_declare_kv`).

    File storage with a short history, so the previous artifacts of a key can be inspected.
    """
    return await _declare_kv(js, KeyValueConfig(
        bucket=S.MODELS_BUCKET, history=5, storage=StorageType.FILE,
        description="latency-model artifacts: latency.<name> and latency.current"), replicas)
