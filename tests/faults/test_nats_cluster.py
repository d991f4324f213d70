"""A ``kairos up --nats-servers 3`` stack (emulated engines) under a steady stream of streaming
requests, while each nats-server in turn is SIGKILLed by its pid and restarted by ``kairos up`` on
its ports and store (issue 17, part 2). The JetStream meta leader and the raft leader of the
requests bucket (the records: off the request path since issue 34, which stores nothing on it) are
among the victims: found from the servers' own monitoring endpoints (``/jsz?leader-only=true`` answers
only on the meta leader; ``/jsz?streams=true`` names each stream's leader).

Counted from the clients (every request ends; a completion's text is exactly the emulated output)
and the node agents' logs (executions per request id). Targets: 0 lost, 0 duplicated, 0 wrong
text, 0 streams cut, p99 TTFT of the requests started during a failover within 2 s of the steady
state's. ``KAIROS_CLUSTER_RESULTS=PATH``: the measured figures are written there as one JSON
object (``python -m tools.docgen record nats-cluster-failover --rows-from PATH -- env
KAIROS_CLUSTER_RESULTS=PATH pytest …``; docs/reliability.md, docs/bus.md).
"""

from __future__ import annotations

import asyncio
from collections import Counter
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from kairos.cli.up import free_port
from kairos.contracts import subjects as S
from tests.faults.conftest import REPO, Outcome, expected_text, get_json, poll, request

pytestmark = pytest.mark.faults

RATE = 20.0  #: requests per second, every one streaming
STEADY_S = 8.0  #: load before the first kill (the steady-state TTFT)
ROUNDS = 2  #: every server is killed once per round
SETTLE_S = 3.0  #: after a killed member is back and current, before the next kill
FAILOVER_WINDOW_S = 4.0  #: requests started this long after a kill count as "during the failover"
MAX_TOKENS = 24


def _jsz(monitor: str, query: str) -> dict | None:
    try:
        with urllib.request.urlopen(f"{monitor}/jsz?{query}", timeout=1) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except (OSError, ValueError):
        return None


RECORDS = f"KV_{S.REQUESTS_BUCKET}"  #: the requests bucket (3 replicas): its leader is one of the victims


def _streams(body: dict) -> list[dict]:
    return [s for a in body.get("account_details", []) for s in a.get("stream_detail", [])]


def leaders(members: list[dict]) -> tuple[str | None, str | None]:
    """(JetStream meta leader, the requests bucket's raft leader), from the members' monitoring endpoints."""
    meta = req = None
    for m in members:
        if (body := _jsz(m["monitor_url"], "leader-only=true")) and "server_id" in body:
            meta = m["name"]
        for s in _streams(_jsz(m["monitor_url"], "streams=true") or {}):
            if s["name"] == RECORDS and s.get("cluster", {}).get("leader"):
                req = s["cluster"]["leader"]
    return meta, req


def healthy(members: list[dict]) -> bool:
    """Every member answers, the meta leader sees its peers current, and the requests bucket has a
    leader again."""
    bodies = {m["name"]: _jsz(m["monitor_url"], "streams=true") for m in members}
    if any(b is None for b in bodies.values()):
        return False
    meta_ok = records_ok = False
    for name, body in bodies.items():
        mc = body.get("meta_cluster", {})
        if mc.get("leader") == name:
            peers = mc.get("replicas", [])
            meta_ok = len(peers) == len(members) - 1 and all(p.get("current") for p in peers)
        records_ok |= any(s["name"] == RECORDS and s.get("cluster", {}).get("leader") == name for s in _streams(body))
    return meta_ok and records_ok


def read_pid(m: dict) -> int | None:
    try:
        return int(Path(m["pid_file"]).read_text().strip())
    except (OSError, ValueError):
        return None


def code(o: Outcome) -> str:
    """A failed outcome's error code (``hung``, ``client_error``, or the HTTP status without one)."""
    if o.hung:
        return "hung"
    err = o.error or {}
    return str(err.get("code") or ("client_error" if "client_error" in err else o.status))


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def start_cluster_stack(tmp_path: Path) -> tuple[subprocess.Popen, str, Path, list[dict]]:
    """``kairos up --nats-servers 3`` with 2 dispatchers, once serving and its cluster healthy:
    (the process, the ingress base URL, the log directory, the members)."""
    logs, port = tmp_path / "logs", free_port()
    logs.mkdir()
    up = subprocess.Popen([sys.executable, "-m", "kairos", "up", "--nats-servers", "3", "--port", str(port),
                           "--log-dir", str(logs), "--dispatchers", "2"], cwd=str(REPO),
                          stdout=open(tmp_path / "up.out", "ab"), stderr=subprocess.STDOUT, start_new_session=True,
                          env={**os.environ, "KAIROS_LOG_LEVEL": "debug"})  # the agents' job_accepted lines
    base = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: up.poll() is not None or get_json(base + "/health")[0] == 200, 90, "the stack up")
        assert up.poll() is None, (tmp_path / "up.out").read_text()[-3000:]
        members = json.loads((logs / "nats-cluster.json").read_text())
        poll(lambda: healthy(members), 30, "a healthy cluster")
    except BaseException:
        stop_stack(up)
        raise
    return up, base, logs, members


def stop_stack(up: subprocess.Popen) -> None:
    """SIGTERM ``kairos up`` (SIGKILL its group if it does not stop within 60 s)."""
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


async def steady_load(http: aiohttp.ClientSession, base: str, results: list[asyncio.Task], stop: asyncio.Event) -> None:
    """Open-loop streaming requests at :data:`RATE` until ``stop``, each a task in ``results``."""
    t_next = time.monotonic()
    while not stop.is_set():
        results.append(asyncio.create_task(request(http, base, MAX_TOKENS, stream=True, prompt_len=64, deadline_s=60)))
        t_next += 1.0 / RATE
        await asyncio.sleep(max(0.0, t_next - time.monotonic()))


async def test_cluster_survives_each_server_killed(tmp_path):
    up, base, logs, members = start_cluster_stack(tmp_path)
    try:
        results: list[asyncio.Task] = []
        kills: list[dict] = []
        stop = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            loader = asyncio.create_task(steady_load(http, base, results, stop))
            t_start = time.monotonic()
            await asyncio.sleep(STEADY_S)  # the steady state is what is measured, not a synchronisation
            for rnd in range(ROUNDS):
                order: list[str] = []
                meta, req = leaders(members)
                for name in (meta, req, *(m["name"] for m in members)):
                    if name and name not in order:
                        order.append(name)
                for name in order:
                    meta, req = leaders(members)
                    m = next(x for x in members if x["name"] == name)
                    pid = read_pid(m)
                    assert pid, f"no pid for {name}"
                    t = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                    kills.append({"round": rnd, "server": name, "t": t, "meta_leader": name == meta,
                                  "records_leader": name == req})
                    await asyncio.to_thread(poll, lambda: read_pid(m) not in (None, pid) and healthy(members), 60,
                                            f"{name} restarted and current", 0.1)
                    kills[-1]["back_s"] = round(time.monotonic() - t, 2)
                    await asyncio.sleep(SETTLE_S)  # load keeps flowing between kills (the steady part)
            stop.set()
            await loader
            load_s = time.monotonic() - t_start
            outcomes = await asyncio.gather(*results)
        assert up.poll() is None, "kairos up exited: " + (tmp_path / "up.out").read_text()[-3000:]
    finally:
        stop_stack(up)
    first_kill = kills[0]["t"]
    steady = [o.ttft_s for o in outcomes if o.started_at < first_kill and o.ttft_s is not None]
    during = [o.ttft_s for o in outcomes if o.ttft_s is not None
              and any(0 <= o.started_at - k["t"] < FAILOVER_WINDOW_S for k in kills)]
    failed = [o for o in outcomes if not o.ok]
    lost = [o for o in failed if not o.explicit_error]  # hung, a connection error, no error code
    cut = [o for o in failed if o.status == 200]  # the stream began, then ended with an error event
    wrong = [o for o in outcomes if o.ok and o.text != expected_text(o.prompt, MAX_TOKENS)]
    # a cut stream carries a prefix of the right output, never other text
    wrong += [o for o in cut if not expected_text(o.prompt, MAX_TOKENS).startswith(o.text)]
    execs: dict[str, int] = {}
    for path in logs.glob("*-[0-9].log"):
        for line in path.read_text(errors="replace").splitlines():
            if '"job_accepted"' in line:
                rid = json.loads(line).get("request_id")
                execs[rid] = execs.get(rid, 0) + 1
    dup = {r: n for r, n in execs.items() if n > 1}
    ingress_log = (logs / "ingress.log").read_text(errors="replace")
    moved = ingress_log.count('"request_resent"')  # its routing went silent (a member died): sent again
    silent = ingress_log.count('"job_unanswered"')  # a job's answer lost with a member: the attempt moved
    row = {"test": "nats-cluster-failover", "servers": 3, "rate_rps": RATE, "sent": len(outcomes),
           "achieved_rps": round(len(outcomes) / load_s, 1), "kills": len(kills),
           "meta_leader_kills": sum(k["meta_leader"] for k in kills),
           "records_leader_kills": sum(k["records_leader"] for k in kills),
           "completed": len(outcomes) - len(failed), "failed": len(failed), "lost": len(lost), "streams_cut": len(cut),
           "wrong_text": len(wrong), "duplicated": len(dup), "route_resends": moved, "jobs_unanswered": silent,
           "error_codes": dict(sorted(Counter(code(o) for o in failed).items())),
           "cut_codes": dict(sorted(Counter(code(o) for o in cut).items())),
           "p99_ttft_steady_s": round(p99(steady), 3), "p99_ttft_failover_s": round(p99(during), 3),
           "max_ttft_failover_s": round(max(during, default=float("nan")), 3),
           "member_back_s": [k["back_s"] for k in kills], "failover_window_s": FAILOVER_WINDOW_S}
    print("NATS cluster failover:", json.dumps(row))
    if os.environ.get("KAIROS_CLUSTER_RESULTS"):
        Path(os.environ["KAIROS_CLUSTER_RESULTS"]).write_text(json.dumps(row) + "\n")
    assert row["meta_leader_kills"] >= 1 and row["records_leader_kills"] >= 1, kills
    # safety holds under every kill: nothing lost, run twice, or mixed
    assert not lost and not wrong and not dup, row
    # availability targets (issue 17): nothing failed or cut, and the failover's p99 TTFT within 2 s of the
    # steady state's (core NATS all the way to the engine: nothing waits for an election)
    if row["achieved_rps"] < RATE * 0.9:  # the client itself fell behind (a loaded machine): not a measurement
        pytest.xfail(f"offered rate not reached: {json.dumps(row)}")
    assert not failed and not cut, row
    assert row["p99_ttft_failover_s"] <= row["p99_ttft_steady_s"] + 2.0, row


def ingress_member(members: list[dict]) -> dict | None:
    """The member the ingress is connected to (its ``/connz`` lists a connection of user ``ingress``)."""
    for m in members:
        body = _get(f"{m['monitor_url']}/connz?auth=true&limit=1024")
        if body and any(c.get("authorized_user") == "ingress" for c in body.get("connections", [])):
            return m
    return None


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


#: longer than the ingress's 3 s liveness timeout, shorter than nats-py's ping-out (6 s): the ingress keeps
#: its connection to the frozen member all along
FREEZE_S = 4.0


async def test_a_frozen_member_refuses_and_cuts_nothing(tmp_path):
    """The ingress's own member SIGSTOPped for 4 s under 20 streaming req/s, then SIGCONTed (issue 32).
    Its connection looks fine to nats-py, but it hears nothing and its publishes get no answer. Before:
    21 of 242 requests answered 503 ``enqueue_failed`` (a publish that timed out on a member answering no
    PING gave up at once), then, with that fixed, 21 streams cut ``node_lost`` (hearing no heartbeat from
    any node for 3 s, the ingress declared all four dead). With two members up, nothing may fail."""
    up, base, logs, members = start_cluster_stack(tmp_path)
    results: list[asyncio.Task] = []
    pid = None
    try:
        member = poll(lambda: ingress_member(members), 10, "the ingress's member")
        stop = asyncio.Event()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            loader = asyncio.create_task(steady_load(http, base, results, stop))
            await asyncio.sleep(3.0)  # load before the fault (what is measured, not a synchronisation)
            pid = read_pid(member)
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(FREEZE_S)  # the fault's duration is the fault
            os.kill(pid, signal.SIGCONT)
            pid = None
            await asyncio.sleep(6.0)  # load after it
            stop.set()
            await loader
            outcomes = await asyncio.gather(*results)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        stop_stack(up)
    failed = [o for o in outcomes if not o.ok]
    wrong = [o for o in outcomes if o.ok and o.text != expected_text(o.prompt, MAX_TOKENS)]
    summary = {"sent": len(outcomes), "failed": len(failed), "wrong_text": len(wrong),
               "error_codes": dict(Counter(code(o) for o in failed))}
    print("frozen member:", json.dumps(summary))
    assert len(outcomes) >= RATE * 10 and not failed and not wrong, summary
