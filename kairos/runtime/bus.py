"""Small NATS helpers: connect, declare the streams/consumers/KV buckets, typed request-reply,
and survive a NATS restart (:class:`BusWatch`).

Every declaration is idempotent (same config → the existing object), so each service declares
what it uses at start and services can start in any order. Names come from :mod:`kairos.contracts.subjects`.

NATS restarts (docs/bus.md "Surviving a NATS restart"): every stream and bucket is file-backed, so a
server restarted on the same store keeps them (queued requests, claims, reservations, the last view);
and every service re-declares what it uses and restarts its KV watchers after each reconnect
(:class:`BusWatch`), so a server that comes back with an empty store is repopulated too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

import msgspec
import nats
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import Header, KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from kairos.contracts import subjects as S
from kairos.runtime.envconfig import ConfigError, read_secret_file
from kairos.contracts.permissions import inbox_prefix, kv_stream
from kairos.contracts.wire import decode, encode

T = TypeVar("T")


class BusAuthError(ConfigError):
    """The NATS credentials cannot be used (unreadable password file)."""


@dataclass(frozen=True)
class BusAuth:
    """NATS credentials of one service (user/password; docs/security.md).

    Attributes:
        user: the role's NATS user (``kairos.contracts.permissions``); its client uses the inbox prefix
            ``_INBOX.<user>``, the only inbox the server lets that role subscribe to.
        password: the password.
    """

    user: str
    password: str = field(repr=False)

    @classmethod
    def from_config(cls, cfg) -> "BusAuth | None":
        """From a :class:`kairos.runtime.envconfig.ServiceConfig` (``KAIROS_NATS_USER`` +
        ``KAIROS_NATS_PASSWORD`` or ``KAIROS_NATS_PASSWORD_FILE``); None when no user is set.

        Raises:
            BusAuthError: the password file cannot be read or is empty.
        """
        if not cfg.nats_user:
            return None
        pw = cfg.nats_password
        if cfg.nats_password_file:
            pw = read_secret_file(cfg.nats_password_file, "nats_password_file", BusAuthError)
        return cls(cfg.nats_user, pw or "")


def tls_context(cfg) -> ssl.SSLContext | None:
    """The client TLS context of a :class:`kairos.runtime.envconfig.ServiceConfig`: verify the server
    against ``KAIROS_NATS_TLS_CA_FILE`` (else the system CAs) and present
    ``KAIROS_NATS_TLS_CERT_FILE``/``KEY_FILE`` if set. None when no TLS file is set (a ``tls://``
    URL then uses nats-py's default context: system CAs, no client certificate).

    Raises:
        BusAuthError: a file is missing or not valid PEM (the message names the variable).
    """
    if not (cfg.nats_tls_ca_file or cfg.nats_tls_cert_file):
        return None
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.nats_tls_ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise BusAuthError(f"KAIROS_NATS_TLS_CA_FILE={cfg.nats_tls_ca_file}: {exc}") from None
    if cfg.nats_tls_cert_file:
        try:
            ctx.load_cert_chain(cfg.nats_tls_cert_file, cfg.nats_tls_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise BusAuthError(f"KAIROS_NATS_TLS_CERT_FILE={cfg.nats_tls_cert_file} / KAIROS_NATS_TLS_KEY_FILE="
                               f"{cfg.nats_tls_key_file}: {exc}") from None
    return ctx


def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL setting: one URL, or a comma-separated list of the members of a
    cluster (``nats://127.0.0.1:4222,nats://127.0.0.1:4223``), blanks dropped.

    Raises:
        ValueError: no URL at all.
    """
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise ValueError(f"no NATS server URL in {url!r}")
    return urls


#: JetStream's largest replication factor (nats-server refuses ``num_replicas`` > 5)
MAX_REPLICAS = 5


def stream_replicas(cfg) -> int:
    """Replicas of every stream and KV bucket a service declares: ``cfg.nats_replicas`` if set
    (> 0), else one per server in ``cfg.nats_url`` (a 3-server cluster: 3, so that a stream
    survives the loss of any one server), at most :data:`MAX_REPLICAS`. ``cfg`` is a
    :class:`kairos.runtime.envconfig.ServiceConfig`. Every service of one deployment must agree (a stream
    re-declared with another replica count is refused), which giving all of them the same URL
    list does."""
    if getattr(cfg, "nats_replicas", 0):
        return cfg.nats_replicas
    return min(len(server_urls(cfg.nats_url)), MAX_REPLICAS)


async def connect_service(cfg, name: str, log=None, errors: list[Exception] | None = None) -> Client:
    """:func:`connect` to ``cfg.nats_url`` (one server, or every member of a cluster:
    :func:`server_urls`) with the credential and TLS settings of ``cfg`` (a
    :class:`kairos.runtime.envconfig.ServiceConfig`). Raises BusAuthError for unusable files."""
    return await connect(cfg.nats_url, name, log, auth=BusAuth.from_config(cfg), tls=tls_context(cfg), errors=errors)


def is_auth_error(exc: Exception) -> bool:
    """True when ``exc`` says the server refused the login (``Authorization Violation``)."""
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


def connect_error_hint(errors: list[Exception]) -> str:
    """Why connecting failed, for a one-shot command's message: a refused login names the
    credential variables (docs/security.md); otherwise the last error, if any (empty string)."""
    if any(is_auth_error(e) for e in errors):
        return ("the server refused the login (Authorization Violation): set KAIROS_NATS_USER and "
                "KAIROS_NATS_PASSWORD or KAIROS_NATS_PASSWORD_FILE (docs/security.md)")
    return f"last error: {errors[-1]!r}" if errors else ""


#: client keep-alive: a ping every this many seconds (nats-py ``ping_interval``; default 120) ...
PING_INTERVAL_S = 2
#: ... and this many unanswered ones make the client drop the server and reconnect to another (a
#: process stalled for a moment, e.g. the 2.5 s pauses of tests/faults, keeps its connection)
MAX_OUTSTANDING_PINGS = 3


async def connect(url: str, name: str, log=None, auth: BusAuth | None = None,
                  tls: ssl.SSLContext | None = None, errors: list[Exception] | None = None) -> Client:
    """Connect with reconnects forever (a restarted nats-server is picked up again).

    ``url``: one server or a comma-separated list (:func:`server_urls`): nats-py then connects to
    one of them (in random order, nats-py's default) and, when that one goes away, reconnects to
    another live one (the pool also learns the cluster's other members from the server's INFO).

    The first connection is retried forever too (every 0.5 s, each failure logged as
    ``nats_error``), so services may start before NATS. This never gives up on its own: to abort
    it (a signal during startup), cancel the awaiting task — ``kairos.runtime.service.run_main`` does.
    With ``auth`` the client logs in as that user and uses its private inbox prefix
    (:func:`kairos.contracts.permissions.inbox_prefix`); a refused login is logged as ``nats_error``
    (``Authorization Violation``). ``tls``: the client TLS context (:func:`tls_context`).
    ``errors``: every connection error is also appended here (a one-shot command that gives up
    says why: :func:`connect_error_hint`). A server that stops answering without closing the
    connection (frozen, SIGSTOP, a stalled VM) is given up after :data:`PING_INTERVAL_S` ×
    :data:`MAX_OUTSTANDING_PINGS` without a pong and another member is tried (nats-py's default,
    2 minutes × 2, left a frozen member's clients cut off for minutes: 50 of 275 requests failed in
    a 15 s freeze of one member of three).
    """

    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(exc)
        if log is not None:
            log.warning("nats_error", error=repr(exc))

    async def on_disconnect() -> None:
        if log is not None:
            log.info("nats_disconnected")

    async def on_reconnect() -> None:
        if log is not None:
            log.info("nats_reconnected")

    creds: dict = {}
    if auth is not None:
        creds = {"user": auth.user, "password": auth.password, "inbox_prefix": inbox_prefix(auth.user)}
    if tls is not None:
        creds["tls"] = tls
    return await nats.connect(server_urls(url), name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                              error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect,
                              connect_timeout=5, drain_timeout=2, ping_interval=PING_INTERVAL_S,
                              max_outstanding_pings=MAX_OUTSTANDING_PINGS, **creds)


async def flush_barrier(nc: Client, timeout: float = 5.0) -> None:
    """Return once the server has processed everything ``nc`` sent before the call (SUB, UNSUB,
    PUB), so that another connection may act on it (e.g. publish to a subject just subscribed).

    ``Client.flush()`` alone does not guarantee this in nats-py 2.16: ``_send_ping`` writes the
    PING straight to the socket while earlier commands still wait in the client's pending buffer
    for the flusher task, so the PONG can come back before the server has seen them (a subscribe
    + flush followed by a publish from another connection lost the message in ~2 % of runs on a
    loaded machine). The first flush kicks the flusher, which writes the pending buffer before the
    first PONG can be read (same event loop); the second PING therefore follows those commands on
    the wire, and its PONG proves they were processed. ``timeout`` is per round trip, seconds.

    Raises:
        nats.errors.FlushTimeoutError: no PONG within ``timeout``.
        nats.errors.ConnectionClosedError: ``nc`` is closed.
    """
    await nc.flush(timeout=timeout)
    await nc.flush(timeout=timeout)


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


#: nats-server's generic "error creating store for stream" (JSStreamCreateErrF): seen when a file
#: stream is created while the store directory of a just-deleted stream of that name is still being
#: removed, or by two services declaring it at the same instant
_STORE_CREATE_ERR = 10049


class StreamConfigMismatch(ConfigError):
    """A stream or KV bucket exists with another configuration than this service declares it with
    (nats-server's "stream name already in use with a different configuration"): the services of
    one deployment disagree on ``KAIROS_NATS_REPLICAS`` / ``KAIROS_NATS_LANES`` / the server URL
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
                    f"member list, KAIROS_NATS_REPLICAS and KAIROS_NATS_LANES (docs/deploy.md); or remove the "
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
    # direct gets: a get names its key in the subject, so the agents' permission can be "claims only"
    try:
        reqs = await _declare_kv(js, KeyValueConfig(
            bucket=S.REQUESTS_BUCKET, history=1, storage=StorageType.FILE, ttl=records_ttl_s, direct=True,
            description="per-request decision records, measured TTFT components and execution claims"), replicas)
    except StreamConfigMismatch as exc:
        if not (await js.stream_info(kv_stream(S.REQUESTS_BUCKET))).config.allow_direct:
            raise BucketLayoutError(
                f"the KV bucket {S.REQUESTS_BUCKET!r} (stream {kv_stream(S.REQUESTS_BUCKET)}) has an older layout without "
                f"direct gets, which node agents need to read execution claims (docs/security.md); delete it "
                f"(nats kv del {S.REQUESTS_BUCKET}, or remove the nats-server's JetStream store) and start "
                f"again: it holds only the last hour's request records and claims") from exc
        raise
    return Buckets(view=view, reservations=resv, requests=reqs)


class BucketLayoutError(ConfigError):
    """A KV bucket in the server's store was created by an older Kairos with a layout this one
    cannot use (:func:`ensure_buckets`); the message names the bucket and what to do."""


#: nats-server's "stream name already in use with a different configuration" (JSStreamNameExistErr)
_IN_USE_ERR = 10058


class BusWatch:
    """Follows one connection's ups and downs and re-establishes what a NATS restart loses.

    nats-py re-subscribes core subscriptions by itself after a reconnect, but a restarted server
    may have lost streams/buckets (empty store) and JetStream watchers (ordered push consumers) may
    be left on a consumer that no longer exists. After every reconnect ``on_reconnect()`` (the
    service's re-declare + restart-watchers coroutine) is retried every ``retry_s`` until it
    succeeds; ``on_connected()`` runs once per reconnect before that (what needs core NATS only:
    it must not wait for JetStream); ``on_disconnect()`` runs when the connection drops. The connection is polled every
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

    def start(self) -> "BusWatch":
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

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
            if n == self._seen and self.disconnected_since is None and not self.resuming:
                continue
            self._seen = n
            self.reconnected_at = time.monotonic()
            # connected again: the outage is over, even while JetStream is still electing leaders
            # (a cluster member died) and the re-declare below keeps failing; core NATS (tokens,
            # jobs, heartbeats) flows already
            # (None: the reconnect came within one poll, the loss was never seen)
            self.outage_s = None if self.disconnected_since is None else self.reconnected_at - self.disconnected_since
            self.disconnected_since = None
            self.resuming = True
            if self.on_connected is not None:  # once per reconnect, before the re-declare (core NATS only)
                await self._safe(self.on_connected, "bus_connected_hook_failed")
            while self.nc.is_connected:  # re-declare until JetStream answers (it may still be recovering)
                if await self._safe(self.on_reconnect, "bus_resume_failed"):
                    break
                await asyncio.sleep(self.retry_s)
            else:
                continue  # dropped again meanwhile: the next round starts over
            self.resuming = False
            self.reconnects += 1
            if self.log is not None:
                self.log.info("bus_resumed", outage_s=None if self.outage_s is None else round(self.outage_s, 3),
                              redeclare_s=round(time.monotonic() - self.reconnected_at, 3))

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
        except Exception as exc:
            if self.log is not None:
                self.log.warning(what, error=repr(exc))
            return False


async def ensure_models_bucket(js: JetStreamContext, replicas: int | None = 1) -> KeyValue:
    """Declare (or open) the latency-model bucket (``kairos profile`` writes, dispatchers watch),
    with ``replicas`` replicas (None: open it whatever its replicas, :func:`_declare_kv`).

    File storage with a short history, so the previous artifacts of a key can be inspected.
    """
    return await _declare_kv(js, KeyValueConfig(
        bucket=S.MODELS_BUCKET, history=5, storage=StorageType.FILE,
        description="latency-model artifacts: latency.<name> and latency.current"), replicas)


async def request_typed(nc: Client, subject: str, msg: msgspec.Struct, reply_type: type[T], timeout: float,
                        headers: dict[str, str] | None = None) -> T:
    """Request-reply with typed bodies.

    Raises:
        nats.errors.NoRespondersError: nobody subscribes to ``subject`` (node gone).
        nats.errors.TimeoutError: no reply within ``timeout`` s (node hung or overloaded).
        kairos.contracts.wire.WireError: the reply does not decode.
    """
    reply = await nc.request(subject, encode(msg), timeout=timeout, headers=headers)
    return decode(reply.data, reply_type)


async def publish(nc: Client, subject: str, msg: msgspec.Struct, headers: dict[str, str] | None = None) -> None:
    """Core-NATS publish of a typed message."""
    await nc.publish(subject, encode(msg), headers=headers)


def kv_subject(bucket: str, key: str) -> str:
    """The subject a write of KV ``bucket``/``key`` is published on (nats-py ``nats/js/kv.py``)."""
    return f"$KV.{bucket}.{key}"


async def kv_put_ttl(nc: Client, bucket: str, key: str, value: bytes, msg_ttl_s: int, timeout_s: float) -> int:
    """``KeyValue.put`` with a per-message TTL (``msg_ttl_s`` seconds; nats-py's ``put`` takes none,
    only ``create`` does): an acknowledged JetStream publish to :func:`kv_subject`. Returns the new
    revision. Raises ``nats.errors.TimeoutError`` (no acknowledgement within ``timeout_s``) or
    ``nats.js.errors.APIError`` (refused)."""
    ack = await nc.jetstream().publish(kv_subject(bucket, key), value, msg_ttl=msg_ttl_s, timeout=timeout_s)
    return ack.seq


async def kv_put_nowait(nc: Client, bucket: str, key: str, value: bytes, msg_ttl_s: int | None = None) -> None:
    """Write KV ``bucket``/``key`` without asking for the server's acknowledgement: a core-NATS
    publish to ``$KV.<bucket>.<key>``, which the bucket's stream stores exactly as ``KeyValue.put``'s
    JetStream publish would (nats-py ``nats/js/kv.py``), with ``Nats-TTL`` for ``msg_ttl_s``
    (seconds; the bucket must allow per-message TTLs).

    One message instead of a request and its acknowledgement, and no round trip: the caller goes
    on at once (issue 12, item 5). Writes of one connection reach the stream in the order they were
    made, so a later :func:`kv_delete_nowait` of the key never overtakes this. What is lost: the
    caller does not learn of a failure (the bus down, a full store); a permission violation reaches
    the connection's error callback (logged as ``nats_error``). For writes that are only
    advisory or records — never for a claim or anything that decides who runs a request.
    """
    headers = {Header.MSG_TTL: str(int(msg_ttl_s))} if msg_ttl_s else None
    await nc.publish(kv_subject(bucket, key), value, headers=headers)


async def kv_delete_nowait(nc: Client, bucket: str, key: str) -> None:
    """Delete KV ``bucket``/``key`` (a delete marker, as ``KeyValue.delete``) without asking for
    the server's acknowledgement; ordered after this connection's earlier writes of the key
    (:func:`kv_put_nowait` has the trade-off)."""
    await nc.publish(kv_subject(bucket, key), b"", headers={"KV-Operation": "DEL"})
