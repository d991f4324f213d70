"""``kairos up`` as a user runs it: separate processes, bundled nats-server, clean teardown; and
service mains that exit non-zero naming a bad config field."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.integration.conftest import free_port

pytestmark = pytest.mark.integration


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie counts as gone
        return f.read().split()[2] != "Z"


def test_kairos_up_serves_and_stops_everything(tmp_path):
    port = free_port()
    trace = tmp_path / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "kairos", "up", "--port", str(port), "--prefill", "1", "--decode", "1",
                             "--dispatchers", "2", "--trace-file", str(trace), "--log-dir", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 90
        while not any(line.startswith("Stop") for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"kairos up exited: {proc.stderr.read()}"
            lines.append(line)
            assert time.monotonic() < deadline, lines
        table = "".join(lines)
        for name in ("nats-server", "state_aggregator", "prefill-0", "decode-0", "dispatcher-0", "dispatcher-1",
                     "ingress"):
            assert name in table, table
        children = _children_of(proc.pid)
        assert len(children) == 7, table
        body = json.dumps({"model": "kairos-emulated", "prompt": "Hello there", "max_tokens": 3}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert not [c for c in children if _alive(c)]
        spans = [json.loads(x) for x in trace.read_text().splitlines()]
        names = {s["name"] for s in spans}
        assert {"ingress.request", "dispatcher.decide"} <= names, names
        assert len({s["context"]["trace_id"] for s in spans if s["name"] in ("ingress.request",
                                                                             "dispatcher.decide")}) == 1
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("module,env,field", [
    ("services.dispatcher", {"KAIROS_POLICY": "bogus"}, "KAIROS_POLICY"),
    ("services.dispatcher", {"KAIROS_ALPHA": "0.5"}, "KAIROS_ALPHA"),
    ("services.node_agent", {"KAIROS_NODE_ID": "decode-0", "KAIROS_ROLE": "middle"}, "KAIROS_ROLE"),
    ("services.node_agent", {"KAIROS_ROLE": "decode"}, "KAIROS_NODE_ID"),
    ("services.ingress", {"KAIROS_PORT": "eighty"}, "KAIROS_PORT"),
    ("services.state_aggregator", {"KAIROS_STATE_PERIOD_MS": "-1"}, "KAIROS_STATE_PERIOD_MS"),
], ids=["policy", "alpha", "role", "missing-node-id", "port", "period"])
def test_bad_config_exits_nonzero_naming_the_field(module, env, field):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    r = subprocess.run([sys.executable, "-m", module], env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert field in r.stderr, r.stderr
