"""What every service main shares: SIGINT/SIGTERM → a stop event, then ``run(config, stop)``.

Lifecycle of ``python -m kairos.services.<name>`` (``run(config, stop)`` = ``start()``, ``await
stop.wait()``, then a draining ``close()``):

* a signal while the service is **serving** (its ``run`` awaits ``stop.wait()``) sets ``stop``: the
  service drains (agents send explicit errors for their in-flight requests, dispatchers finish
  routing, …) and the process exits **0**;
* a signal while it is still **starting** (e.g. ``kairos.runtime.bus.connect`` retrying an unreachable
  NATS forever) cancels the startup at once: the process exits **128 + signal number** (143 for
  SIGTERM, 130 for SIGINT) within a moment;
* a **second** signal during the drain cancels the drain too (exit 128 + signal number).

A bad ``KAIROS_*`` value exits 2 before any of this (``kairos.runtime.envconfig.main_config``); a
:class:`~kairos.runtime.envconfig.ConfigError` or
:class:`~kairos.core.model.latency.LatencyProfileError` raised during startup (an unreadable password
or API key file, a tokenizer that does not load, no such ``KAIROS_PROFILE``) exits 2 too, and an
``OSError`` during startup (the HTTP port in use, a host that is not this machine's) exits 1: each
with one line on stderr, no traceback.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any, Awaitable, Callable

from kairos.core.model.latency import LatencyProfileError
from kairos.runtime.envconfig import ConfigError
from kairos.runtime.resources import Resources


class StopEvent(asyncio.Event):
    """An :class:`asyncio.Event` that remembers whether anyone has waited on it yet: the service
    ``run`` functions await ``stop.wait()`` only once their startup is complete, so ``serving`` tells
    "draining is meaningful" from "still connecting / declaring"."""

    serving: bool = False
    signum: int | None = None  #: the first signal that set it (SIGTERM: drain gracefully; SIGINT: stop now)

    async def wait(self) -> bool:  # type: ignore[override]
        self.serving = True
        return await super().wait()


async def run_main(run: Callable[..., Awaitable[Any]], config: Any) -> None:
    """Run a service until SIGINT/SIGTERM, then let it drain (see the module docstring).

    Raises:
        SystemExit: 128 + signal number when the run was cancelled (signal during startup, or a
            second signal during the drain).
    """
    stop = StopEvent()
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(run(config, stop))
    got: list[int] = []

    def on_signal(signum: int) -> None:
        got.append(signum)
        if not stop.is_set():
            stop.signum = signum
            stop.set()
            if stop.serving:
                return  # serving: drain through run's own close()
        task.cancel()  # still starting (nothing to drain), or a second signal: stop now

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await task
    except (ConfigError, LatencyProfileError) as exc:  # found at startup (an unreadable password or API
        print(f"bad configuration: {exc}", file=sys.stderr)  # key file, no such KAIROS_PROFILE, …)
        raise SystemExit(2) from None
    except OSError as exc:
        if stop.serving:
            raise
        # still starting: a port in use, a host that is not an address of this machine (no traceback)
        print(f"cannot start: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except asyncio.CancelledError:
        if not got or not task.cancelled():
            raise  # cancelled from outside, not by a signal
        raise SystemExit(128 + got[-1]) from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


#: ``KAIROS_EVENT_LOOP`` values: ``auto`` (uvloop when installed, else asyncio's own loop)
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def run_on_event_loop(main: Awaitable[Any], service: str) -> Any:
    """Run the coroutine ``main`` to completion on the event loop ``KAIROS_EVENT_LOOP`` names and
    return its result — ``auto`` (default): uvloop if installed (libuv's loop in C: the services
    spend most of their CPU in the event loop and socket I/O, issue 12 item 5), else asyncio's;
    ``uvloop`` (required); ``asyncio`` (the standard library's selector loop). ``service`` names the
    program in error messages.

    Raises:
        SystemExit: 2 with a message naming the variable for an unknown value or a missing uvloop
            (``main`` is closed, never run); else whatever ``main`` raises.
    """
    choice = os.environ.get("KAIROS_EVENT_LOOP", "auto").strip().lower() or "auto"
    if choice not in EVENT_LOOPS:
        print(f"{service}: bad configuration: KAIROS_EVENT_LOOP: {choice!r} is not one of {', '.join(EVENT_LOOPS)}",
              file=sys.stderr)
        main.close()
        raise SystemExit(2)
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                print(f"{service}: bad configuration: KAIROS_EVENT_LOOP: uvloop is not installed", file=sys.stderr)
                main.close()
                raise SystemExit(2) from None
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def serve(run: Callable[..., Awaitable[Any]], config: Any, service: str) -> None:
    """``python -m kairos.services.<name>``: :func:`run_main` on the event loop ``KAIROS_EVENT_LOOP``
    names (:func:`run_on_event_loop`).

    Raises:
        SystemExit: 2 with a message naming the variable for an unknown value or a missing uvloop;
            else as :func:`run_main`.
    """
    run_on_event_loop(run_main(run, config), service)


async def start_metrics_and_connect(svc: Any, client_name: str, res: Resources | None = None,
                                    graceful: Callable[[], bool] = lambda: True) -> None:
    """The startup every non-HTTP service shares: its ``/metrics`` + ``/health`` server (healthy =
    connected to NATS; skipped when ``cfg.metrics_port`` is -1), then the NATS connection.

    ``svc`` has ``cfg`` (a :class:`kairos.runtime.envconfig.MetricsServiceConfig`), ``tel`` and ``log``;
    this sets ``svc._runner`` and ``svc.metrics_port`` (before connecting, so a cancelled startup
    can still clean up) and ``svc.nc``. With ``res``, each is registered there as soon as it is open
    (``metrics server``, then ``nats connection``: closed in reverse), the connection flushed first
    when ``graceful()`` says so at close time.
    """
    from kairos.runtime import telemetry
    from kairos.runtime.bus import close, connect_service

    cfg = svc.cfg
    if cfg.metrics_port >= 0:
        svc._runner, svc.metrics_port = await telemetry.start_metrics_server(
            svc.tel.registry, cfg.metrics_host, cfg.metrics_port,
            health=lambda: svc.nc is not None and svc.nc.is_connected)
        if res is not None:
            res.push("metrics server", svc._runner.cleanup)
    svc.nc = await connect_service(cfg, client_name, svc.log)
    if res is not None:
        res.push("nats connection", lambda: close(svc.nc, graceful=graceful(), log=svc.log))


async def run_service(svc: Any, stop: asyncio.Event) -> None:
    """A service's ``run(config, stop)``: ``svc.start()``, wait for ``stop``, then ``svc.close()`` —
    which also runs when the start failed or was cancelled (a signal during startup), so whatever
    the start had opened is closed (:class:`kairos.runtime.resources.Resources`)."""
    try:
        await svc.start()
        await stop.wait()
    finally:
        await svc.close()


def forward(path: str, doc: str) -> property:
    """A service attribute that is ``path`` (``part.attribute``) of one of its parts: the composition
    root (a service's class) keeps the names tests and tools read while the state lives in its parts.
    Reading and assigning both go to the part."""
    part, name = path.split(".")
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


def forward_all(part: str, *names: str) -> tuple[property, ...]:
    """:func:`forward` for several attributes of one part kept under their own names, in order:
    ``view, reservations = forward_all("state", "view", "reservations")``."""
    return tuple(forward(f"{part}.{name}", f"``{part}.{name}``") for name in names)

