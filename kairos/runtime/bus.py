"""The NATS connection of a service: servers, credentials, TLS, keep-alive, reconnects, close.

Every service and one-shot command connects through :func:`connect_service` (a
:class:`kairos.runtime.envconfig.ServiceConfig`'s URL list, user/password and TLS files) or
:func:`connect`, which reconnects forever: a restarted nats-server, or another member of a NATS
cluster, is picked up again (docs/bus.md "Surviving a NATS restart"); a one-shot command bounds its
first connection with :func:`connect_within`. :func:`stream_replicas` is the replica count every
stream and bucket is declared with, derived from the same URL list.

The rest of the bus helpers, by concern: :mod:`kairos.runtime.streams` (stream, consumer and KV
bucket declarations), :mod:`kairos.runtime.messaging` (typed publish and request-reply, KV writes
without a round trip), :mod:`kairos.runtime.buswatch` (re-declaring after a reconnect).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass, field

import nats
import nats.errors
import structlog
from nats.aio.client import Client

from kairos.contracts.permissions import inbox_prefix
from kairos.runtime.envconfig import ConfigError, read_secret_file

_log = structlog.get_logger("kairos.runtime")


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


async def connect_within(url: str, timeout_s: float, cfg=None, *, name: str) -> Client:
    """A client of ``url`` (:func:`connect`; with ``cfg``, a
    :class:`kairos.runtime.envconfig.ServiceConfig`: its credentials and TLS, :func:`connect_service`)
    for a one-shot command, named ``name``. :func:`connect` retries forever (services may start
    before NATS); this gives up after ``timeout_s`` seconds, or at once when the server refused the
    login (retrying cannot fix credentials).

    Raises:
        RuntimeError: no connection (with the server's reason when it gave one:
            :func:`connect_error_hint`).
        BusAuthError: ``cfg``'s password file is unusable.
    """
    errors: list[Exception] = []
    login = connect(url, name, errors=errors) if cfg is None else connect_service(cfg, name, errors=errors)
    task = asyncio.ensure_future(login)
    deadline = time.monotonic() + timeout_s
    while not task.done() and time.monotonic() < deadline and not any(is_auth_error(e) for e in errors):
        await asyncio.wait({task}, timeout=min(0.1, max(deadline - time.monotonic(), 0.0)))
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        hint = connect_error_hint(errors)
        raise RuntimeError(f"cannot connect to NATS at {url}"
                           + ("" if any(is_auth_error(e) for e in errors) else
                              f" within {timeout_s:g} s") + (f": {hint}" if hint else ""))
    return task.result()


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


#: what flushing or closing a connection that is going away may raise (nats-py errors, the socket's)
_CLOSE_ERRORS = (nats.errors.Error, asyncio.TimeoutError, OSError)


async def close(nc: Client | None, graceful: bool = True, log=_log) -> None:
    """Flush what is buffered (``graceful``) and close; never hangs for long.

    A flush or close the connection's state makes fail (no server, a lost socket) is logged on
    ``log`` (``nats_flush_failed`` / ``nats_close_failed``) and not raised: the connection is going
    away, and nothing it could still send would be waited for.
    """
    if nc is None or nc.is_closed:
        return
    if graceful and nc.is_connected:
        try:
            await nc.flush(timeout=1)
        except _CLOSE_ERRORS as exc:
            log.info("nats_flush_failed", error=repr(exc))
    try:
        await nc.close()
    except _CLOSE_ERRORS as exc:
        log.info("nats_close_failed", error=repr(exc))
