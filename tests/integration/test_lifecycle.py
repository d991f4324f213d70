"""Service mains as real processes: a signal stops them promptly whether they are still starting
(NATS unreachable: ``kairos.runtime.bus.connect`` retries forever) or serving, with the exit codes
documented in ``kairos/runtime/service.py``; and a SIGKILLed ``kairos up`` leaves no orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.integration.conftest import free_port
from tests.integration.test_up import alive, children_of, spawn, start_up, wait_gone  # noqa: F401 (spawn: fixture)

pytestmark = pytest.mark.integration

SERVICE_ENV = {
    "kairos.services.dispatcher": {"KAIROS_REPLICA_ID": "dispatcher-t"},
    "kairos.services.state_aggregator": {},
    "kairos.services.node_agent": {"KAIROS_NODE_ID": "decode-0", "KAIROS_ROLE": "decode"},
    "kairos.services.ingress": {"KAIROS_PORT": "0"},
}


def _service(spawn, module: str, nats_url: str, log_path, **extra: str) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    env = {**clean, **SERVICE_ENV[module], "KAIROS_NATS_URL": nats_url, "KAIROS_LOG_FORMAT": "json", **extra}
    with open(log_path, "wb") as log:
        return spawn([sys.executable, "-m", module], env=env, stdout=log, stderr=subprocess.STDOUT,
                     stdin=subprocess.DEVNULL)


def _wait_for_log(proc: subprocess.Popen, log_path, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in log_path.read_text(errors="replace"):
        assert proc.poll() is None, f"exited {proc.returncode}: {log_path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout}s: {log_path.read_text()}"
        time.sleep(0.05)


def _dead_nats_url() -> str:
    return f"nats://127.0.0.1:{free_port()}"  # bound then released: nothing listens there


@pytest.mark.parametrize("module,sig", [
    ("kairos.services.dispatcher", signal.SIGTERM),
    ("kairos.services.state_aggregator", signal.SIGTERM),
    ("kairos.services.node_agent", signal.SIGTERM),
    ("kairos.services.ingress", signal.SIGTERM),
    ("kairos.services.dispatcher", signal.SIGINT),
], ids=["dispatcher", "state_aggregator", "node_agent", "ingress", "dispatcher-sigint"])
def test_signal_while_nats_is_unreachable_stops_the_service(module, sig, spawn, tmp_path):
    log = tmp_path / "service.log"
    proc = _service(spawn, module, _dead_nats_url(), log)
    _wait_for_log(proc, log, "nats_error")  # inside connect's retry loop
    t0 = time.monotonic()
    proc.send_signal(sig)
    try:
        code = proc.wait(5)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{module} still running 5 s after {sig.name}: {log.read_text()[-2000:]}")
    assert code == 128 + sig, (code, log.read_text()[-2000:])
    assert time.monotonic() - t0 < 5
    assert "Traceback" not in log.read_text(), log.read_text()


def test_sigterm_while_serving_drains_and_exits_0(nats_url, spawn, tmp_path):
    """The startup cancellation must not replace the drain of a running service."""
    log = tmp_path / "agent.log"
    mport = free_port()
    proc = _service(spawn, "kairos.services.node_agent", nats_url, log, KAIROS_METRICS_PORT=str(mport))
    _wait_for_log(proc, log, "agent_started")
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/health", timeout=5) as r:
        assert r.status == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0, log.read_text()[-2000:]
    assert "Traceback" not in log.read_text(), log.read_text()


def test_sigkilled_kairos_up_leaves_no_orphans(spawn, tmp_path):
    """``kill -9`` of ``kairos up``: NATS and every service get SIGTERM from the kernel
    (PR_SET_PDEATHSIG); the services lose NATS at the same moment and must still exit."""
    proc, _ = start_up(spawn, free_port(), "--prefill", "1", "--decode", "1", "--dispatchers", "1", tmpdir=tmp_path)
    children = children_of(proc.pid)
    assert len(children) == 6
    proc.kill()
    proc.wait(5)
    assert not wait_gone(children, 15), [open(f"/proc/{p}/cmdline").read() for p in children if alive(p)]
