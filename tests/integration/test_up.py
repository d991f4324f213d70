"""``kairos up`` as a user runs it: separate processes, bundled nats-server, clean teardown (also
with requests in flight), a busy port, and a child's death stopping everything.

The processes are started by the ``spawn`` fixture of tests/integration/up_helpers.py, which kills
every process a test started whatever its outcome. The restarts of a dead child are in
test_up_restarts.py, the credentials in test_up_auth.py.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.integration.conftest import free_port
# spawn: the fixture; alive: not used here, but test_lifecycle.py imports it (with children_of, spawn,
# start_up, wait_gone) from this module, as tests/vllm/servers/test_bench_parity.py does spawn and start_up
from tests.integration.up_helpers import alive, children_of, post, spawn, start_up, wait_gone  # noqa: F401

pytestmark = pytest.mark.integration


def test_kairos_up_serves_and_stops_everything(tmp_path, spawn):
    port = free_port()
    trace = tmp_path / "spans.jsonl"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc, table = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", "2", "--trace-file",
                           str(trace), "--log-dir", str(tmp_path / "logs"), tmpdir=tmpdir)
    for name in ("nats-server", "state_aggregator", "prefill-0", "decode-0", "dispatcher-0", "dispatcher-1",
                 "ingress"):
        assert name in table, table
    children = children_of(proc.pid)
    assert len(children) == 7, table
    status, out = post(port, {"model": "kairos-emulated", "prompt": "Hello there", "max_tokens": 3})
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    err = proc.stderr.read()
    assert err.rstrip().endswith("kairos up: stopped"), err
    assert "did not stop" not in err, err
    assert not wait_gone(children, 5)
    assert os.listdir(tmpdir) == [], "the temp dir (NATS store) must be removed on exit"
    assert (tmp_path / "logs" / "ingress.log").stat().st_size > 0
    assert f"logs kept in {tmp_path / 'logs'}" in err, err  # a clean stop keeps the evidence too
    spans = [json.loads(x) for x in trace.read_text().splitlines()]
    names = {s["name"] for s in spans}
    assert {"ingress.request", "dispatcher.decide"} <= names, names
    assert len({s["context"]["trace_id"] for s in spans if s["name"] in ("ingress.request",
                                                                         "dispatcher.decide")}) == 1


def _read_sse(resp: http.client.HTTPResponse, events: list, first: threading.Event) -> None:
    """Collect ``data:`` payloads (decoded JSON, or the string ``[DONE]``) until EOF."""
    try:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            first.set()
    except OSError as exc:  # a cut connection: recorded, the assertions below then fail
        events.append(exc)
    finally:
        first.set()


def test_sigterm_with_requests_in_flight_ends_them_explicitly(tmp_path, spawn):
    """Ctrl-C / SIGTERM of ``kairos up`` while a stream and a plain request are being decoded: the
    dispatchers and agents are stopped before the ingress (the agents at once, SIGINT: the whole
    stack goes), so the requests they held cannot move and both clients get the ingress's explicit
    ``ingress_shutdown`` (streams: an error event then ``[DONE]``), nothing is SIGKILLed, every child
    exits and the temp dir is removed."""
    port = free_port()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc, _ = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", "1", tmpdir=tmpdir)
    children = children_of(proc.pid)
    assert len(children) == 6
    long = {"model": "kairos-emulated", "prompt": "Hello there", "max_tokens": 5000}

    plain: dict = {}
    t_plain = threading.Thread(target=lambda: plain.update(zip(("status", "body"), post(port, long, timeout=60))))
    t_plain.start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**long, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events: list = []
    first = threading.Event()
    t_stream = threading.Thread(target=_read_sse, args=(resp, events, first))
    t_stream.start()
    assert first.wait(30) and events and isinstance(events[0], dict) and "choices" in events[0], events

    proc.send_signal(signal.SIGTERM)
    t_stream.join(60)
    t_plain.join(60)
    assert not t_stream.is_alive() and not t_plain.is_alive()
    assert proc.wait(30) == 0
    err = proc.stderr.read()
    assert "did not stop" not in err, err
    assert err.rstrip().endswith("kairos up: stopped"), err

    assert events[-1] == "[DONE]", events[-3:]
    last = events[-2]
    assert isinstance(last, dict), events[-3:]
    if "error" in last:
        assert last["error"]["code"] == "ingress_shutdown", last
    else:  # finished just before the stop
        assert last["choices"][0]["finish_reason"] is not None, last
    assert plain["status"] in (200, 503), plain
    if plain["status"] == 503:
        assert plain["body"]["error"]["code"] == "ingress_shutdown", plain
    else:
        assert plain["body"]["usage"]["completion_tokens"] == long["max_tokens"], plain
    assert not wait_gone(children, 5)
    left = list(tmpdir.iterdir())  # the logs stay after a clean stop (issue 11), nothing else does
    assert len(left) == 1 and [p.name for p in left[0].iterdir()] == ["logs"], left
    assert (left[0] / "logs" / "ingress.log").stat().st_size > 0


def test_busy_port_fails_before_starting_anything(tmp_path, spawn):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))  # all addresses: a connect-only check on 127.0.0.1 sees it too,
        busy.listen()              # but only a bind check would see one bound to another address
        port = busy.getsockname()[1]
        proc = spawn([sys.executable, "-m", "kairos", "up", "--port", str(port)], env={"TMPDIR": str(tmpdir)},
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, (out, err)
    assert f"port {port}" in err and "already in use" in err, err
    assert "nats-server" not in err, err
    assert err.rstrip().endswith("kairos up: stopped"), err
    assert os.listdir(tmpdir) == [], "nothing started, nothing left behind"


def test_with_restarts_off_the_death_of_the_only_dispatcher_stops_everything_and_keeps_the_logs(tmp_path, spawn):
    """--max-restarts 0: a child that exits is reported, not restarted; the only dispatcher gone, nothing
    can serve: everything stops (exit 1), the logs are kept. (With restarts, the default, it comes back:
    tests/integration/test_up_restarts.py.)"""
    port = free_port()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc, table = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", "1", "--max-restarts", "0",
                           tmpdir=tmpdir)
    children = children_of(proc.pid)
    victim = next(int(line.split()[-2]) for line in table.splitlines() if line.strip().startswith("dispatcher-0"))
    assert victim in children
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(30) == 1
    err = proc.stderr.read()
    assert "dispatcher-0" in err and "was killed by SIGKILL and is not restarted (--max-restarts 0)" in err, err
    assert "no dispatcher is left: stopping everything" in err, err
    assert err.rstrip().endswith("kairos up: stopped"), err
    kept = [line.split("logs kept in ", 1)[1].strip() for line in err.splitlines() if "logs kept in " in line]
    assert len(kept) == 1, err
    assert Path(kept[0]).is_relative_to(tmpdir) and (Path(kept[0]) / "dispatcher-0.log").stat().st_size > 0
    assert not (Path(kept[0]).parent / "jetstream").exists()  # the NATS store is not worth keeping
    assert not wait_gone(children, 5)
