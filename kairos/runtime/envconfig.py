"""Service configuration from the environment: ``KAIROS_<FIELD>`` → a frozen dataclass field.

Every service has one frozen dataclass; :func:`from_env` fills it from ``KAIROS_<FIELD_UPPER>``
variables (types from the annotations: str, int, float, bool, tuple[str, ...] as comma lists,
optional ``| None``), and :func:`main_config` exits non-zero naming the offending variable.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import types
import typing
import urllib.parse
from typing import Any, Literal, Mapping, TypeVar

T = TypeVar("T")
ENV_PREFIX = "KAIROS_"


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the variable."""


#: URL schemes nats-py connects with (nats/aio/client.py: plain, TLS, WebSocket)
NATS_SCHEMES = ("nats", "tls", "ws", "wss")
#: structlog/logging level names a service accepts (KAIROS_LOG_LEVEL, any case)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def env_name(field: str) -> str:
    """``node_id`` → ``KAIROS_NODE_ID``."""
    return ENV_PREFIX + field.upper()


def _convert(raw: str, typ: Any, var: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw.strip() == "" or raw.strip().lower() == "none":
            return None
        return _convert(raw, args[0], var)
    if origin is tuple:
        (inner, *_) = typing.get_args(typ)
        return tuple(_convert(x.strip(), inner, var) for x in raw.split(",") if x.strip())
    if origin is typing.Literal:
        if raw not in typing.get_args(typ):
            raise ConfigError(f"{var}={raw!r}: must be one of {', '.join(map(str, typing.get_args(typ)))}")
        return raw
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if typ is int:
            return int(raw)
        if typ is float:
            value = float(raw)
            if not math.isfinite(value):  # inf/nan pass float() but no duration, rate or factor is infinite
                raise ValueError("must be a finite number")
            return value
        if typ is str:
            return raw
    except ValueError as exc:
        raise ConfigError(f"{var}={raw!r}: {exc}") from None
    raise ConfigError(f"{var}: unsupported field type {typ!r}")


def from_env(cls: type[T], env: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build ``cls`` from ``KAIROS_*`` variables; ``overrides`` win over the environment.

    Raises:
        ConfigError: an unparsable value, a missing required field, or the dataclass's own
            ``__post_init__`` check failed (its message should name the field).
    """
    env = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
            continue
        var = env_name(f.name)
        if var in env:
            kwargs[f.name] = _convert(env[var], hints[f.name], var)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            raise ConfigError(f"{var} is required")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def to_env(cfg: Any) -> dict[str, str]:
    """The inverse of :func:`from_env` (``kairos up`` passes configs to child processes this way)."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None:
            out[env_name(f.name)] = ""
        elif isinstance(v, bool):
            out[env_name(f.name)] = "true" if v else "false"
        elif isinstance(v, tuple):
            out[env_name(f.name)] = ",".join(map(str, v))
        else:
            out[env_name(f.name)] = str(v)
    return out


def require(cond: bool, field: str, message: str) -> None:
    """For ``__post_init__`` checks: raise ConfigError naming ``KAIROS_<FIELD>``."""
    if not cond:
        raise ConfigError(f"{env_name(field)}: {message}")


def read_secret_file(path: str, field: str, error: type[Exception] = ConfigError) -> str:
    """The content (stripped) of the secret file ``path`` that the variable ``KAIROS_<FIELD>`` names
    (a password, an API key; Docker-secrets style).

    Raises:
        error (default ConfigError): the file cannot be read or is empty; the message names the
            variable and the path, never the content.
    """
    try:
        secret = open(path, encoding="utf-8").read().strip()
    except OSError as exc:
        raise error(f"{env_name(field)}={path}: {exc.strerror}") from None
    if not secret:
        raise error(f"{env_name(field)}={path} is empty")
    return secret


def main_config(cls: type[T], service: str) -> T:
    """``from_env`` for a service main: on error print it and exit 2."""
    try:
        return from_env(cls)
    except ConfigError as exc:
        print(f"{service}: bad configuration: {exc}", file=sys.stderr)
        sys.exit(2)


def check_nats_auth(cfg: Any) -> None:
    """The NATS credential and TLS fields of a :class:`ServiceConfig` are consistent (raises ConfigError)."""
    has_pw = bool(cfg.nats_password) or bool(cfg.nats_password_file)
    require(not (cfg.nats_password and cfg.nats_password_file), "nats_password_file",
            "set either KAIROS_NATS_PASSWORD or KAIROS_NATS_PASSWORD_FILE, not both")
    require(bool(cfg.nats_user) or not has_pw, "nats_user", "a NATS password needs KAIROS_NATS_USER")
    require(not cfg.nats_user or has_pw, "nats_password",
            f"KAIROS_NATS_USER={cfg.nats_user} needs KAIROS_NATS_PASSWORD or KAIROS_NATS_PASSWORD_FILE")
    require(bool(cfg.nats_tls_cert_file) == bool(cfg.nats_tls_key_file), "nats_tls_key_file",
            "a client certificate needs both KAIROS_NATS_TLS_CERT_FILE and KAIROS_NATS_TLS_KEY_FILE")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """Fields every service has (inherit it; they are keyword-only and come after the service's own).

    Attributes:
        nats_url: the NATS server (JetStream enabled), or every member of a NATS cluster as a
            comma-separated list (the client reconnects to a live one; ``kairos.runtime.bus.server_urls``).
        nats_replicas: replicas of every stream and KV bucket this service declares; 0: one per
            URL in ``nats_url``, at most 5 (``kairos.runtime.bus.stream_replicas``).
        nats_user: NATS user (the service's role: ``ingress``, ``dispatcher``, ``aggregator``,
            ``profiler``, ``agent-<node>``; ``kairos/contracts/permissions.py``); None: no authentication.
        nats_password: its password (prefer ``nats_password_file``: environments leak).
        nats_password_file: a file whose content (stripped) is the password (Docker secrets).
        nats_tls_ca_file: PEM CA bundle the NATS server's certificate must chain to (a private
            CA; default: the system CAs when the URL is ``tls://``).
        nats_tls_cert_file: PEM client certificate (mutual TLS, server ``verify: true``).
        nats_tls_key_file: its private key (PEM).
        trace_file: append finished spans as JSON lines here (``kairos trace`` reads it).
        log_level: structlog level name.
        log_format: ``auto`` (console on a TTY, else JSON lines), ``json`` or ``console``.
    """

    nats_url: str = "nats://127.0.0.1:4222"
    nats_replicas: int = 0
    nats_user: str | None = None
    nats_password: str | None = dataclasses.field(default=None, repr=False)
    nats_password_file: str | None = None
    nats_tls_ca_file: str | None = None
    nats_tls_cert_file: str | None = None
    nats_tls_key_file: str | None = None
    trace_file: str | None = None
    log_level: str = "info"
    log_format: Literal["auto", "json", "console"] = "auto"

    def __post_init__(self) -> None:
        check_nats_auth(self)
        require(any(u.strip() for u in self.nats_url.split(",")), "nats_url", "needs at least one server URL")
        for url in (u.strip() for u in self.nats_url.split(",") if u.strip()):
            parts = urllib.parse.urlsplit(url if "://" in url else "nats://" + url)
            require(parts.scheme in NATS_SCHEMES and bool(parts.hostname) and "://" in url, "nats_url",
                    f"{url!r} is not a NATS server URL (scheme://host:port, scheme one of {', '.join(NATS_SCHEMES)})")
        require(self.log_level.lower() in LOG_LEVELS, "log_level", f"must be one of {', '.join(LOG_LEVELS)}")
        require(0 <= self.nats_replicas <= 5, "nats_replicas", "must be 0 (one per server URL) .. 5")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MetricsServiceConfig(ServiceConfig):
    """A service without its own HTTP server: it serves ``/metrics`` and ``/health`` on a small one.

    Attributes:
        metrics_host: bind address of that server.
        metrics_port: its port; 0 picks a free one, -1 disables it.
    """

    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(-1 <= self.metrics_port <= 65535, "metrics_port", "must be -1..65535")
