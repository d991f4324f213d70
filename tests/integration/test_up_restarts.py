"""``kairos up`` when one of its children dies: a dead dispatcher replica leaves the stack serving;
a killed bundled nats-server, state aggregator or vLLM engine (a stand-in,
tests/integration/vllm_standin.py) is started again and the stack serves again."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import free_port
from tests.integration.up_helpers import post, spawn, start_up  # noqa: F401 (spawn: fixture)

pytestmark = pytest.mark.integration


def up_and_kill(spawn, tmp_path: Path, child: str, dispatchers: int) -> tuple[subprocess.Popen, int]:
    """``kairos up`` 1P1D with ``dispatchers`` replicas, then SIGKILL its child ``child`` (by the
    pid in the printed table); returns the ``kairos up`` process and its ingress port."""
    port = free_port()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc, table = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", str(dispatchers),
                           tmpdir=tmpdir)
    victim = next(int(line.split()[-2]) for line in table.splitlines() if line.strip().startswith(child))
    os.kill(victim, signal.SIGKILL)
    return proc, port


def stop_after_a_death(proc: subprocess.Popen, what: str) -> str:
    """``kairos up`` is still serving after ``what`` died: SIGTERM it; it exits 1 (a child died during
    the run). Returns its stderr."""
    assert proc.poll() is None, f"kairos up stopped after {what} died"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 1
    return proc.stderr.read()


def test_a_dead_replica_is_restarted_and_the_stack_keeps_serving(tmp_path, spawn):
    """One of two dispatchers killed: kairos up says why it stopped and starts it again (issue 33: as
    compose's restart policy), serving all along; the exit code then says a child died."""
    proc, port = up_and_kill(spawn, tmp_path, "dispatcher-0", dispatchers=2)
    for _ in range(3):  # served by dispatcher-1 or the new dispatcher-0 (a request the dead one pulled is redelivered)
        status, out = post(port, {"model": "kairos-emulated", "prompt": "still there?", "max_tokens": 3})
        assert status == 200, out
    err = stop_after_a_death(proc, "one replica")
    assert re.search(r"dispatcher-0 \(pid \d+\) was killed by SIGKILL; restarting it in 0.1 s with the same "
                     r"configuration \(restart 1 of at most 5 in 10 min\)", err), err
    assert re.search(r"dispatcher-0 restarted as pid \d+", err) and "stopping everything" not in err, err


def test_a_killed_bundled_nats_server_is_restarted_and_the_stack_serves_again(tmp_path, spawn):
    """README: "a NATS restart is survived by every service on its own" — with the bundled
    nats-server too: kairos up starts it again on the same port and store, and requests succeed."""
    proc, port = up_and_kill(spawn, tmp_path, "nats-server", dispatchers=1)
    deadline = time.monotonic() + 60
    while True:  # the services reconnect at their own pace: bounded retries, each one a real request
        status, out = post(port, {"model": "kairos-emulated", "prompt": "still there?", "max_tokens": 3})
        if status == 200:
            break
        assert status == 503 and time.monotonic() < deadline, (status, out)
    err = stop_after_a_death(proc, "the nats-server")
    assert "nats-server (pid" in err and "was killed by SIGKILL; restarting it" in err, err
    assert "on the same port and store" in err and re.search(r"nats-server restarted as pid \d+", err), err
    assert "stopping everything" not in err, err


def test_a_killed_state_aggregator_is_restarted_and_health_recovers(tmp_path, spawn):
    """The aggregator is a singleton: without it the view goes stale and /health stays 503 although
    requests are still routed on the last view. kairos up starts it again; /health is 200 again."""
    proc, port = up_and_kill(spawn, tmp_path, "state_aggregator", dispatchers=1)

    def health() -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    deadline = time.monotonic() + 60
    while health() != 503:  # the view goes stale without an aggregator (before the new one writes)
        assert time.monotonic() < deadline, "the ingress never saw the view go stale"
        time.sleep(0.05)
    while health() != 200:  # bounded: the new aggregator listens for one stale period, then writes the view
        assert time.monotonic() < deadline, "/health never recovered"
        time.sleep(0.1)
    status, out = post(port, {"model": "kairos-emulated", "prompt": "still there?", "max_tokens": 3})
    assert status == 200, out
    err = stop_after_a_death(proc, "the aggregator")
    assert re.search(r"state_aggregator \(pid \d+\) was killed by SIGKILL; restarting it in 0.1 s with the same "
                     r"configuration \(restart 1 of at most 5 in 10 min\)", err), err
    assert re.search(r"state_aggregator restarted as pid \d+", err), err  # the new pid (the table shows the first one's)


def standin_engines(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A model directory (a word-level tokenizer.json) and the environment that makes ``kairos up
    --engine vllm`` start :mod:`tests.integration.vllm_standin` in place of each vLLM server (its
    records go to ``tmp_path/engines``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = tmp_path / "model"
    model.mkdir()
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(model / "tokenizer.json"))
    records = tmp_path / "engines"
    records.mkdir()
    wrapper = tmp_path / "vllm-python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).with_name("vllm_standin.py")}" "$@"\n')
    wrapper.chmod(0o755)
    return model, {"KAIROS_VLLM_PYTHON": str(wrapper), "KAIROS_TEST_STANDIN_DIR": str(records)}


def engine_records(tmp_path: Path, port: str) -> list[dict]:
    """What every stand-in engine started on ``port`` wrote at its start (oldest first)."""
    recs = [json.loads(p.read_text()) for p in (tmp_path / "engines").glob("*.json")]
    recs = [r for r in recs if r["argv"][r["argv"].index("--port") + 1] == port]
    return sorted(recs, key=lambda r: (tmp_path / "engines" / f"{r['pid']}.json").stat().st_mtime_ns)


def routable(port: int) -> set[str]:
    """The nodes the ingress routes to now (``/health``'s ``routable``; empty when it answers 503)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as e:
        body = json.loads(e.read())
    return set(body.get("routable", {}).get("prefill", [])) | set(body.get("routable", {}).get("decode", []))


def test_a_dead_vllm_engine_is_restarted_with_the_same_command_and_its_agent_serves_again(tmp_path, spawn):
    """Issue 16 §5: a vLLM engine that dies is started again by ``kairos up`` (same command line, so
    the same port and engine-state socket); its agent notices the death at once (engine_lost),
    waits for the new server's model list (engine_ready again) and its node is routable again."""
    model, env = standin_engines(tmp_path)
    port = free_port()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    logs = tmp_path / "logs"
    proc, table = start_up(spawn, port, "--engine", "vllm", "--model", str(model), "--prefill", "1", "--decode",
                           "1", "--dispatchers", "1", "--log-dir", str(logs), tmpdir=tmpdir, env=env)
    row = next(line.split() for line in table.splitlines() if line.strip().startswith("vllm-decode-0"))
    victim, engine_port = int(row[-2]), row[-1].rsplit(":", 1)[1]
    (first,) = engine_records(tmp_path, engine_port)
    assert first["pid"] == victim
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while len(recs := engine_records(tmp_path, engine_port)) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, "the engine was not restarted"
        time.sleep(0.05)
    again = recs[1]
    assert again["pid"] != victim and (again["argv"], again["state_addr"]) == (first["argv"], first["state_addr"])
    assert first["api_key"] and again["api_key"] == first["api_key"]  # it refuses /v1/* without the key

    def agent_events() -> list[str]:
        return [json.loads(x).get("event") for x in (logs / "decode-0.log").read_text().splitlines()
                if x.startswith("{")]

    while agent_events().count("engine_ready") < 2 or "decode-0" not in routable(port):
        assert time.monotonic() < deadline, (agent_events(), routable(port))
        time.sleep(0.05)
    events = agent_events()
    assert events.index("engine_lost") > events.index("engine_ready"), events  # refused in between
    err = stop_after_a_death(proc, "a vLLM engine")
    assert "vllm-decode-0 (pid" in err and "restarting it in 0.1 s with the same command" in err, err
    assert "stopping everything" not in err and "keeps serving without it" not in err, err
