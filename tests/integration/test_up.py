"""``kairos up`` as a user runs it: separate processes, bundled nats-server, clean teardown (also
with requests in flight, on a busy port and when a child dies); and service mains that exit
non-zero naming a bad config field.

Every process a test starts carries a unique tag in its environment (inherited by ``kairos up``'s
children); the ``spawn`` fixture's finalizer SIGKILLs every process with that tag, so no test —
passing or failing — leaves orphans behind, even ones already re-parented to init.
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
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.integration.conftest import free_port

pytestmark = pytest.mark.integration

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


def post(port: int, body: dict, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stop_after_a_death(proc: subprocess.Popen, what: str) -> str:
    """``kairos up`` is still serving after ``what`` died: SIGTERM it; it exits 1 (a child died during
    the run). Returns its stderr."""
    assert proc.poll() is None, f"kairos up stopped after {what} died"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 1
    return proc.stderr.read()


# -- tests ----------------------------------------------------------------------------------------

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
    agents are stopped before the ingress, so both clients get ``node_shutdown`` (streams: an error
    event then ``[DONE]``), nothing is SIGKILLed, every child exits and the temp dir is removed."""
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
        assert last["error"]["code"] == "node_shutdown", last
    else:  # finished just before the stop
        assert last["choices"][0]["finish_reason"] is not None, last
    assert plain["status"] in (200, 503), plain
    if plain["status"] == 503:
        assert plain["body"]["error"]["code"] == "node_shutdown", plain
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


def test_child_death_stops_everything_and_keeps_the_logs(tmp_path, spawn):
    port = free_port()
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    proc, table = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", "1", tmpdir=tmpdir)
    children = children_of(proc.pid)
    victim = next(int(line.split()[-2]) for line in table.splitlines() if line.strip().startswith("dispatcher-0"))
    assert victim in children
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(30) == 1
    err = proc.stderr.read()
    assert "dispatcher-0" in err and "exited unexpectedly" in err, err
    assert err.rstrip().endswith("kairos up: stopped"), err
    kept = [line.split("logs kept in ", 1)[1].strip() for line in err.splitlines() if "logs kept in " in line]
    assert len(kept) == 1, err
    assert Path(kept[0]).is_relative_to(tmpdir) and (Path(kept[0]) / "dispatcher-0.log").stat().st_size > 0
    assert not (Path(kept[0]).parent / "jetstream").exists()  # the NATS store is not worth keeping
    assert not wait_gone(children, 5)


def test_a_dead_replica_does_not_stop_the_stack(tmp_path, spawn):
    """One of two dispatchers killed: kairos up reports it and keeps serving with the other (the
    reliability the README promises must be visible locally); the exit code then says a child died."""
    proc, port = up_and_kill(spawn, tmp_path, "dispatcher-0", dispatchers=2)
    for _ in range(3):  # served by dispatcher-1 (a request dispatcher-0 had pulled is redelivered)
        status, out = post(port, {"model": "kairos-emulated", "prompt": "still there?", "max_tokens": 3})
        assert status == 200, out
    err = stop_after_a_death(proc, "one replica")
    assert "dispatcher-0" in err and "keeps serving without it" in err and "stopping everything" not in err, err


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
    assert "nats-server exited unexpectedly" in err and "restarted it on the same port" in err, err
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
    assert "state_aggregator exited unexpectedly" in err and "restarted it with the same configuration" in err, err


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
    assert "vllm-decode-0 exited unexpectedly" in err and "restarted it with the same configuration" in err, err
    assert "stopping everything" not in err and "keeps serving without it" not in err, err


def test_demo_progress_is_on_unless_turned_off(monkeypatch):
    """Progress is on by default, also under a non-TTY stderr (CliRunner, CI, ``make run | tee``),
    where the bench client prints periodic lines instead of a bar (issue 11)."""
    from click.testing import CliRunner

    import kairos.cli.demo
    from kairos.cli.main import main

    seen = []
    monkeypatch.setattr(kairos.cli.demo, "run_demo", lambda opts, **kw: seen.append(kw["progress"]) or 0)
    for args in ([], ["--progress"], ["--no-progress"]):
        r = CliRunner().invoke(main, ["demo", *args])
        assert r.exit_code == 0, r.output
    assert seen == [True, True, False]
    assert kairos.cli.demo.progress_default(None) is True
    assert kairos.cli.demo.progress_default(False) is False


@pytest.mark.parametrize("module,env,field", [
    ("kairos.services.dispatcher", {"KAIROS_POLICY": "bogus"}, "KAIROS_POLICY"),
    ("kairos.services.dispatcher", {"KAIROS_ALPHA": "0.5"}, "KAIROS_ALPHA"),
    ("kairos.services.node_agent", {"KAIROS_NODE_ID": "decode-0", "KAIROS_ROLE": "middle"}, "KAIROS_ROLE"),
    ("kairos.services.node_agent", {"KAIROS_ROLE": "decode"}, "KAIROS_NODE_ID"),
    ("kairos.services.ingress", {"KAIROS_PORT": "eighty"}, "KAIROS_PORT"),
    ("kairos.services.state_aggregator", {"KAIROS_STATE_PERIOD_MS": "-1"}, "KAIROS_STATE_PERIOD_MS"),
    ("kairos.services.dispatcher", {"KAIROS_NATS_USER": "dispatcher"}, "KAIROS_NATS_PASSWORD"),
    ("kairos.services.state_aggregator", {"KAIROS_NATS_PASSWORD": "x"}, "KAIROS_NATS_USER"),
    ("kairos.services.node_agent", {"KAIROS_NODE_ID": "decode-0", "KAIROS_ROLE": "decode", "KAIROS_NATS_USER": "agent-decode-0",
                             "KAIROS_NATS_PASSWORD_FILE": "/nonexistent/pw"}, "KAIROS_NATS_PASSWORD_FILE"),
    ("kairos.services.ingress", {"KAIROS_API_KEY_FILE": "/nonexistent/keys"}, "KAIROS_API_KEY_FILE"),
], ids=["policy", "alpha", "role", "missing-node-id", "port", "period", "user-without-password",
        "password-without-user", "unreadable-password-file", "unreadable-api-key-file"])
def test_bad_config_exits_nonzero_naming_the_field(module, env, field):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KAIROS_")}
    r = subprocess.run([sys.executable, "-m", module], env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert field in r.stderr, r.stderr


def _call(port: int, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode() if body else None,
                                 headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            return r.status, dict(r.headers), json.loads(raw) if path != "/metrics" else {}
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_kairos_up_with_api_key_and_nats_credentials(tmp_path, spawn):
    """The whole stack serves with per-role NATS credentials (no permission violation logged by
    the server), refuses anonymous bus clients, and requires the API key on /v1/*."""
    import asyncio

    import nats
    import nats.errors

    port = free_port()
    logs = tmp_path / "logs"
    proc, table = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", "1", "--api-key",
                           "sk-test-1", "--log-dir", str(logs))
    assert "API key required" in table and "one generated user per service role" in table, table
    body = {"model": "kairos-emulated", "prompt": "Hello there", "max_tokens": 3}
    status, headers, out = _call(port, "/v1/completions", body)
    assert status == 401 and out["error"]["code"] == "invalid_api_key", out
    assert out["error"]["type"] == "invalid_request_error" and headers.get("WWW-Authenticate") == "Bearer"
    status, _, out = _call(port, "/v1/completions", body, key="sk-wrong")
    assert status == 401 and "sk-wrong" not in json.dumps(out), out
    assert _call(port, "/v1/models")[0] == 401
    assert _call(port, "/health")[0] == 200  # probes stay open
    assert _call(port, "/metrics")[0] == 200
    status, _, out = _call(port, "/v1/completions", body, key="sk-test-1")
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    chat = {"model": "kairos-emulated", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(chat).encode(),
                                 {"Content-Type": "application/json", "Authorization": "Bearer sk-test-1"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and r.read().rstrip().endswith(b"data: [DONE]")
    # the request record is read back from the KV bucket under the ingress's credential
    deadline = time.monotonic() + 10
    while ((rec := _call(port, f"/v1/requests/{out['id']}", key="sk-test-1"))[0] != 200
           or not all(rec[2]["records"][p] for p in ("ingress", "prefill", "decode"))):
        assert time.monotonic() < deadline, rec
        time.sleep(0.1)
    nats_url = next(w for w in table.split() if w.startswith("nats://"))

    async def anonymous() -> None:
        await nats.connect(nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)

    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
        asyncio.run(anonymous())
    # the table says how to profile a node of this stack: the profiler's password file logs in
    line = next(ln for ln in table.splitlines() if ln.startswith("Profile"))
    pw_file = next(w.split("=", 1)[1] for w in line.split() if w.startswith("KAIROS_NATS_PASSWORD_FILE="))
    assert "KAIROS_NATS_USER=profiler" in line and f"--nats-url {nats_url}" in line, line

    async def as_profiler() -> None:
        nc = await nats.connect(nats_url, user="profiler", password=Path(pw_file).read_text().strip(),
                                allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        await nc.close()

    asyncio.run(as_profiler())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    server_log = (logs / "nats-server.log").read_text()
    assert "authentication error" in server_log  # our anonymous attempt was logged ...
    assert "Violation" not in server_log, \
        [ln for ln in server_log.splitlines() if "Violation" in ln][:5]  # ... and no service hit a permission


def test_kairos_up_on_an_external_nats_with_the_deployment_auth_config(tmp_path, spawn):
    """An operator's nats-server configured with `kairos nats-auth` (passwords from its
    environment) and `kairos up --nats-url … --nats-secrets-dir …` on it: requests are served."""
    secrets = tmp_path / "secrets"
    r = subprocess.run([sys.executable, "-m", "kairos", "nats-auth", "--nodes", "prefill-0,decode-0",
                        "--secrets-dir", str(secrets)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    conf = subprocess.run([sys.executable, "-m", "kairos", "nats-auth", "--nodes", "prefill-0,decode-0"],
                          capture_output=True, text=True, timeout=60).stdout
    (tmp_path / "nats.conf").write_text(conf)
    server_env = dict(ln.split("=", 1) for ln in (secrets / "nats-server.env").read_text().splitlines())
    nport = free_port()
    spawn([str(Path(sys.executable).parent / "nats-server"), "-c", str(tmp_path / "nats.conf"), "-js", "-a",
           "127.0.0.1", "-p", str(nport), "-sd", str(tmp_path / "js")], env=server_env,
          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", nport), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "nats-server did not start"
            time.sleep(0.05)
    port = free_port()
    proc, _ = start_up(spawn, port, "--prefill", "1", "--decode", "1", "--dispatchers", "1", "--nats-url",
                       f"nats://127.0.0.1:{nport}", "--nats-secrets-dir", str(secrets))
    status, out = post(port, {"model": "kairos-emulated", "prompt": "Hello there", "max_tokens": 3})
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert (secrets / "ingress.password").is_file()  # an operator's secrets are never removed


def test_demo_rejects_a_bad_workload_before_starting_anything(tmp_path, monkeypatch):
    """`kairos demo --workload nope` is a usage error at once, not after the stack came up."""
    from click.testing import CliRunner

    import kairos.cli.demo
    from kairos.cli.main import main

    started = []
    monkeypatch.setattr(kairos.cli.demo, "demo_command", lambda **o: started.append(o))
    r = CliRunner().invoke(main, ["demo", "--workload", "nope"])
    assert r.exit_code == 2 and "--workload" in r.stderr and started == []
    r = CliRunner().invoke(main, ["demo", "--duration", "1e12"])
    assert r.exit_code == 2 and "--duration" in r.stderr and started == []
