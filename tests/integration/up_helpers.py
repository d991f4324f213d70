"""Helpers for the integration tests that run ``kairos up`` and other real processes
(tests/integration/test_up*.py, test_lifecycle.py, tests/vllm/servers/test_bench_parity.py).

Every process a test starts carries a unique tag in its environment (inherited by ``kairos up``'s
children); the ``spawn`` fixture's finalizer SIGKILLs every process with that tag, so no test —
passing or failing — leaves orphans behind, even ones already re-parented to init. A test module
uses the fixture by importing it (``from tests.integration.up_helpers import spawn  # noqa: F401``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

TAG_VAR = "PYTEST_KAIROS_PROCESS_TAG"


# -- process helpers ------------------------------------------------------------------------------

def tagged_pids(tag: str) -> list[int]:
    """Every live process whose environment carries ``TAG_VAR=tag``."""
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if needle in env and alive(int(d)):
            pids.append(int(d))
    return pids


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # a zombie counts as gone
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Poll until every pid has exited; returns those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@pytest.fixture
def spawn():
    """``spawn(argv, env=..., **popen_kw)`` → Popen in its own session, tagged; teardown kills (by
    pid and process group) every process carrying the tag, whatever the test's outcome."""
    tag = uuid.uuid4().hex
    procs: list[subprocess.Popen] = []

    def start(argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, env={**os.environ, **(env or {}), TAG_VAR: tag}, start_new_session=True, **kw)
        procs.append(p)
        return p

    yield start
    deadline = time.monotonic() + 15
    while (pids := tagged_pids(tag)) and time.monotonic() < deadline:
        for pid in pids:
            for kill in (os.killpg, os.kill):  # each child of kairos up leads its own process group
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        wait_gone(pids, 2)
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
    assert not tagged_pids(tag), "could not kill the processes this test started"


def start_up(spawn, port: int, *args: str, tmpdir: Path | None = None,
             env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """``kairos up`` (1P1D unless ``args`` say otherwise; ``env`` added to its environment); returns
    the process and its table."""
    env = {**(env or {}), **({"TMPDIR": str(tmpdir)} if tmpdir is not None else {})}
    proc = spawn([sys.executable, "-m", "kairos", "up", "--port", str(port), *args], env=env,
                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 90
    while not any(line.startswith("Stop") for line in lines):
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"kairos up exited: {proc.stderr.read()}"
        lines.append(line)
        assert time.monotonic() < deadline, lines
    return proc, "".join(lines)


def post(port: int, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
