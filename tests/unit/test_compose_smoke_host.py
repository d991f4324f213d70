"""The compose smoke run's Docker host (``ops/compose-smoke/dockerhost.py``): one run at a time per
host, and what a killed run left is removed before the next one's ``up``.

A cold run of CI failed with "ports of the stack are in use" (issue 32): an earlier smoke run had
been stopped with its stack up, and the next dockerd restarted the ``unless-stopped`` containers.
The lock tests need nothing; the leftover test needs Docker and runs in the compose tier."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "ops" / "compose-smoke"


def _load(name: str):
    """Import ``ops/compose-smoke/<name>.py`` the way ``python ops/compose-smoke/smoke.py`` does
    (its directory first on ``sys.path``)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


dockerhost = _load("dockerhost")


def _holder(lock: Path) -> subprocess.Popen:
    """A separate process that holds ``lock`` and says so on stdout, then waits to be killed."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(HERE)!r})
        import dockerhost
        from pathlib import Path
        with dockerhost.host_lock(Path({str(lock)!r}), wait_s=5):
            print("held", flush=True)
            sys.stdin.read()  # until the test closes stdin or kills this process
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_waits_for_the_lock_and_gives_up_after_its_wait(tmp_path):
    lock = tmp_path / "smoke.lock"
    holder = _holder(lock)
    try:
        t0 = time.monotonic()
        with pytest.raises(dockerhost.StepFailed, match="another compose smoke run held"):
            with dockerhost.host_lock(lock, wait_s=0.6, poll_s=0.05):
                pytest.fail("took the lock another process holds")
        assert time.monotonic() - t0 >= 0.6  # it waited before giving up
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_run_never_blocks_the_next(tmp_path):
    """SIGKILL releases the flock: the next run takes it at once (no stale lock file to clean)."""
    lock = tmp_path / "smoke.lock"
    holder = _holder(lock)
    holder.kill()
    holder.wait()
    with dockerhost.host_lock(lock, wait_s=0.0) as path:
        assert path == lock and lock.exists()


def test_the_lock_is_released_when_the_block_ends_and_when_it_raises(tmp_path):
    lock = tmp_path / "smoke.lock"
    with pytest.raises(RuntimeError):
        with dockerhost.host_lock(lock, wait_s=0.0):
            raise RuntimeError("a step failed")
    holder = _holder(lock)  # another process can take it now
    holder.kill()
    holder.wait()


# ---- compose tier: Docker and the base image the smoke run just used ------------------------------

LEFTOVER_PORT = 9113  # one of smoke.PORTS (the last agent's /metrics)


def _port_busy() -> bool:
    smoke = _load("smoke")
    return LEFTOVER_PORT in smoke.ports_in_use()


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.2)


@pytest.mark.compose
def test_a_stack_left_by_a_killed_run_comes_back_with_dockerd_and_is_removed_before_up(tmp_path):
    """The cold-run failure, reproduced: a container of the smoke project holding a stack port, with
    the compose file's restart policy, outlives its run; dockerd stops (the machine's restart) and
    starts again, restarts it, and the port is taken — until :func:`remove_leftovers` runs."""
    assert not _port_busy(), f"port {LEFTOVER_PORT} is in use before the test"
    started = None if dockerhost.docker_up() else dockerhost.start_dockerd(tmp_path)
    try:
        dockerhost.sh(["docker", "run", "-d", "--network", "host", "--restart", "unless-stopped",
                       "--label", f"com.docker.compose.project={dockerhost.PROJECT}", dockerhost.BASE_IMAGE,
                       "python3", "-m", "http.server", str(LEFTOVER_PORT), "--bind", "127.0.0.1"], capture=True)
        _wait(_port_busy, 30, "the planted container listens")
        if started is not None:  # the machine restarting: dockerd goes, comes back, restarts the container
            started.terminate()
            started.wait(timeout=60)
            _wait(lambda: not _port_busy(), 30, "dockerd's stop stops the container")
            started = dockerhost.start_dockerd(tmp_path)
            _wait(_port_busy, 60, "dockerd restarts the unless-stopped container")
        removed = dockerhost.remove_leftovers()
        assert removed["container"] == 1
        assert not _port_busy()
        left = dockerhost.sh(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={dockerhost.PROJECT}"],
                             capture=True).stdout.split()
        assert left == []
    finally:
        dockerhost.remove_project()
        if started is not None:
            started.terminate()
            started.wait(timeout=60)
