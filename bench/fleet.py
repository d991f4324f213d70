"""Control plane at fleet scale: the real aggregator, 2 dispatchers and ingress on a real nats-server,
under the bus traffic of N prefill + M decode node agents made by a few processes.

Each fleet process hosts many real :class:`kairos.services.node_agent.agent.NodeAgent` objects on one
event loop (no /metrics server each), with the near-zero emulated engine of ``bench/control_plane.py``
(~0.05 ms steps): every node heartbeats its ``NodeState`` on ``kairos.state.<node>`` every 100 ms, sends
its step records, accepts jobs (reservations) and publishes tokens/done on the out
subject exactly as a deployed agent — only the engine is a stand-in. The stack (NATS with ``-m`` for
``/varz``, aggregator, dispatchers, ingress; no NATS auth: the fleet's per-node users would need a
password each) comes from ``kairos up``'s supervisor with 0P0D; then the fleet joins.

Per size (``2P2D``, ``8P64D``, ``32P256D``) it runs ``bench/control_plane.py``'s open-loop client at a
fixed rate and writes one row: the dispatchers' own decision time (``kairos_dispatcher_decision_seconds``,
p50/p99 interpolated in its buckets, and the mean) and view age per decision
(``kairos_dispatcher_decision_state_age_seconds``: p50/p99, decisions on a view older than 3 heartbeat
periods), their CPU per request, the aggregator's CPU (% of a core) and views/s
(``kairos_aggregator_views_total``), nats-server messages in/out per second (``/varz``), the fleet's CPU,
the ingress's added latency p50/p99 (as ``bench/control_plane.py``), failed requests, and every process
kind's CPU per request (``cpu_ms_per_request``) and per node and second (``cpu_ms_per_node_s``). Right before
each size's stack starts it also measures the machine's floor at the same rate (``bus_floor_ms``:
``bench/bus_floor.py``'s :data:`FLOOR_VARIANT`, the bare NATS operations of one deflected request by three
nats-py processes that do nothing else, on their own nats-server): the part of the added latency no
service code can remove on these cores at that moment. It prints a table and the growth 2P2D →
largest size of each cost. Not a test: figures depend on the machine.

Usage::

    python bench/fleet.py [--sizes 2x2,8x64,32x256] [--rate 100] [--duration 20] [--floor-duration 10]
                          [--json out/fleet.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import control_plane as cp  # noqa: E402  (bench/control_plane.py: the stack's helpers, the client)

TARGET_P50_MS = 5.0
TARGET_P99_MS = 25.0
HEARTBEAT_MS = 100.0
STALE_PERIODS = 3  #: no decision on a view older than this many heartbeat periods
NODES_PER_PROCESS = 96
#: processes of the harness (what stands in for the fleet's hosts and the users), not of the control plane
HARNESS_KINDS = ("fleet", "client")


# -- pure helpers ------------------------------------------------------------------------------------

def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: the ``q`` quantile (0..1) of cumulative ``buckets``
    ``[(upper bound, count ≤ bound), …]`` sorted by bound (``inf`` last), interpolated linearly in
    its bucket (from 0 in the first); the highest finite bound when it falls in ``+Inf``. None if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_le, prev_c = le, c
    return prev_le


def count_above(limit: float, buckets: list[tuple[float, float]]) -> float:
    """Observations above ``limit`` (s) for sure: the total minus the count of the smallest bound ≥ ``limit``."""
    if not buckets:
        return 0.0
    below = next((c for le, c in buckets if le >= limit), buckets[-1][1])
    return buckets[-1][1] - below


def growth(first: float | None, last: float | None) -> float | None:
    """``last / first`` (None when either is missing or ``first`` is 0)."""
    if first is None or last is None or first == 0:
        return None
    return round(last / first, 2)


# -- scraping ----------------------------------------------------------------------------------------

def scrape(url: str) -> dict[str, dict]:
    """Histograms (name → {le: count, "_sum": s, "_count": n}) and counters (name → value) of one
    ``/metrics``, summed over label sets other than ``le``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                h = out.setdefault(s.name[:-7], {})
                le = float(s.labels["le"])
                h[le] = h.get(le, 0.0) + s.value
            elif s.name.endswith(("_sum", "_count")):
                base, _, part = s.name.rpartition("_")
                h = out.setdefault(base, {})
                h["_" + part] = h.get("_" + part, 0.0) + s.value
            elif s.name.endswith("_total"):
                c = out.setdefault(s.name, {})
                c["value"] = c.get("value", 0.0) + s.value
    return out


def scrape_all(urls: list[str]) -> dict[str, dict]:
    """:func:`scrape` of each of ``urls``, summed."""
    tot: dict[str, dict] = {}
    for u in urls:
        for name, d in scrape(u).items():
            t = tot.setdefault(name, {})
            for k, v in d.items():
                t[k] = t.get(k, 0.0) + v
    return tot


def hist_delta(before: dict, after: dict, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets, sum, count) of histogram ``name`` between two scrapes."""
    a, b = after.get(name, {}), before.get(name, {})
    buckets = sorted((k, v - b.get(k, 0.0)) for k, v in a.items() if isinstance(k, float))
    return buckets, a.get("_sum", 0.0) - b.get("_sum", 0.0), a.get("_count", 0.0) - b.get("_count", 0.0)


# -- the fleet ---------------------------------------------------------------------------------------

async def host_agents(nats_url: str, profile: str, nodes: list[str], slots: int) -> None:
    """Run one real node agent per ``nodes`` entry (``prefill-<i>``/``decode-<i>``) until SIGTERM."""
    from kairos.services.node_agent.agent import NodeAgent
    from kairos.services.node_agent.config import AgentConfig

    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    agents = [NodeAgent(AgentConfig(node_id=n, role=n.split("-")[0], profile=profile, nats_url=nats_url,
                                    metrics_port=-1, state_period_ms=HEARTBEAT_MS, max_deflections=slots,
                                    log_level="warning")) for n in nodes]
    await asyncio.gather(*(a.start() for a in agents))
    print(f"fleet process {os.getpid()}: {len(agents)} agents up", file=sys.stderr, flush=True)
    await stop.wait()
    await asyncio.gather(*(a.close(drain=False) for a in agents), return_exceptions=True)


def start_fleet(nats_url: str, profile: str, prefill: int, decode: int, slots: int,
                per_process: int, log_dir: Path) -> list[subprocess.Popen]:
    """The fleet processes (``--host-agents``), ``per_process`` nodes each, prefill and decode mixed."""
    nodes = [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)]
    k = max(1, math.ceil(len(nodes) / per_process))
    procs = []
    for j in range(k):
        part = nodes[j::k]
        logf = open(log_dir / f"fleet-{j}.log", "ab")
        procs.append(subprocess.Popen([sys.executable, __file__, "--host-agents", "--nats", nats_url, "--profile",
                                       profile, "--slots", str(slots), "--nodes", ",".join(part)],
                                      stdout=logf, stderr=subprocess.STDOUT, start_new_session=True))
        logf.close()
    return procs


def health(url: str) -> dict | None:
    """The ingress's ``/health`` body, 200 or 503 (None if it does not answer)."""
    import urllib.error

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b"null")
    except OSError:
        return None


def wait_routable(url: str, want: int, procs: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """Until the ingress is healthy and lists ``want`` routable nodes. Raises RuntimeError."""
    deadline = time.monotonic() + timeout_s
    body = None
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a fleet process exited during startup")
        body = health(url)
        if body and body["status"] == "ok" and len(body["routable"]["prefill"]) + len(body["routable"]["decode"]) >= want:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{want} nodes not routable after {timeout_s} s: /health {body}")


#: the bus_floor.py variant whose operations are the product's request path: ``arbiter`` since issue
#: 34's second step (the ingress sends the job; before it, ``kairos``: queue, job, claim)
FLOOR_VARIANT = "arbiter"


def bus_floor(rate: float, duration_s: float) -> dict | None:
    """The machine's floor now (module docstring): ``bench/bus_floor.py``'s :data:`FLOOR_VARIANT` at
    ``rate`` for ``duration_s`` on a nats-server of its own; ``{"p50", "p99"}`` ms, None when
    ``duration_s`` is 0."""
    if duration_s <= 0:
        return None
    from contextlib import ExitStack

    import bus_floor as bf  # bench/bus_floor.py
    from kairos.cli.up import start_bundled_nats

    with ExitStack() as stack:
        row = bf.run_variant(start_bundled_nats(stack, "kairos-fleet-floor-"), FLOOR_VARIANT, [rate], duration_s)[0]
    return {**row["latency_ms"], "variant": FLOOR_VARIANT}


def per_node_second(cpu_pct: dict[str, float | None], nodes: int) -> dict[str, float | None]:
    """CPU ms each process kind spent per node and second (``cpu_pct``: % of one core over the run):
    what one more node costs that process, whatever the request rate (issue 34)."""
    return {k: None if v is None else round(v * 10.0 / nodes, 3) for k, v in cpu_pct.items()}


def cpu_split(cpu_pct: dict[str, float | None]) -> dict[str, float]:
    """CPU % of one core of the harness (:data:`HARNESS_KINDS`) and of the control plane (the rest:
    nats-server, aggregator, dispatchers, ingress)."""
    harness = sum(v or 0.0 for k, v in cpu_pct.items() if k in HARNESS_KINDS)
    plane = sum(v or 0.0 for k, v in cpu_pct.items() if k not in HARNESS_KINDS)
    return {"harness": round(harness, 1), "control_plane": round(plane, 1)}


def run_size(prefill: int, decode: int, args, prof: Path, engine_ms: float, tmp: Path) -> dict:
    """One size: the machine's floor, stack up, fleet up, warm-up, the measured run; its row."""
    from kairos.cli.up import Supervisor, UpOptions, free_port
    from kairos.core.policy.registry import policy_spec

    floor = bus_floor(args.rate, args.floor_duration)

    mport = free_port()
    opts = UpOptions(port=free_port(), profile=str(prof), prefill=0, decode=0, dispatchers=2, nats_auth=False,
                     log_dir=str(tmp / f"logs-{prefill}P{decode}D"), nats_monitor_port=mport,
                     state_period_ms=HEARTBEAT_MS)
    sup = Supervisor(opts)
    fleet: list[subprocess.Popen] = []
    try:
        # the ingress is healthy only with routable nodes: the fleet joins as soon as NATS listens
        # (agents heartbeat and wait for the control plane), from a thread, while the supervisor waits
        # for readiness here (its children die with the thread that started them: PR_SET_PDEATHSIG)
        def join() -> None:
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                nats = [c.endpoint for c in list(sup.procs) if c.endpoint.startswith("nats://")]
                if nats and len(sup.procs) >= 2:
                    fleet.extend(start_fleet(nats[0], str(prof), prefill, decode,
                                             policy_spec(opts.policy).deflection_slots, args.per_process, sup.log_dir))
                    return
                time.sleep(0.1)

        th = threading.Thread(target=join, daemon=True)
        th.start()
        sup.up()
        th.join()
        url = f"http://{opts.host}:{opts.port}"
        wait_routable(url, prefill + decode, fleet)
        disp = [c.endpoint for c in sup.procs if c.kind == "dispatcher"]
        agg = [c.endpoint for c in sup.procs if c.kind == "aggregator"]
        pids = {**cp.stack_pids(sup), "fleet": [p.pid for p in fleet]}
        monitor = f"http://127.0.0.1:{mport}"
        cp.run_rate(url, args.rate, args.warmup, args.prompt_tokens, args.output_tokens, engine_ms)  # warm-up
        m0, a0, cpu0, bus0, t0 = scrape_all(disp), scrape_all(agg), cp.cpu_by_kind(pids), cp.bus_counters(monitor), \
            time.monotonic()
        row = cp.run_rate(url, args.rate, args.duration, args.prompt_tokens, args.output_tokens, engine_ms, pids,
                          monitor)
        # run_rate's own CPU/bus figures end before its record lookup; these include it (a few ms/request)
        m1, a1, cpu1, bus1, t1 = scrape_all(disp), scrape_all(agg), cp.cpu_by_kind(pids), cp.bus_counters(monitor), \
            time.monotonic()
    finally:
        for p in fleet:
            p.send_signal(signal.SIGTERM)
        for p in fleet:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        sup.down()
        sup.cleanup()
    wall = t1 - t0
    dec, dsum, dn = hist_delta(m0, m1, "kairos_dispatcher_decision_seconds")
    age, asum, an = hist_delta(m0, m1, "kairos_dispatcher_decision_state_age_seconds")
    views = a1.get("kairos_aggregator_views_total", {}).get("value", 0.0) - \
        a0.get("kairos_aggregator_views_total", {}).get("value", 0.0)
    q = lambda b, x: None if histogram_quantile(x, b) is None else round(histogram_quantile(x, b) * 1000.0, 3)  # noqa
    cpu_req = row["cpu_ms_per_request"]
    return {
        "size": f"{prefill}P{decode}D", "prefill": prefill, "decode": decode, "nodes": prefill + decode,
        "fleet_processes": len(fleet), "offered_rps": args.rate, "duration_s": args.duration,
        "requests": row["requests"], "failed": row["failed"], "achieved_rps": row["achieved_rps"],
        "added_ms": row["added_ms"], "client_added_ms": row["client_added_ms"], "bus_floor_ms": floor,
        "decision_ms": {"p50": q(dec, 0.5), "p99": q(dec, 0.99), "mean": round(dsum / dn * 1000, 3) if dn else None,
                        "n": int(dn)},
        "state_age_ms": {"p50": q(age, 0.5), "p99": q(age, 0.99), "mean": round(asum / an * 1000, 1) if an else None,
                         "over_3_periods": int(count_above(STALE_PERIODS * HEARTBEAT_MS / 1000.0, age)), "n": int(an)},
        "dispatcher_cpu_ms_per_request": cpu_req.get("dispatcher"),
        "aggregator_cpu_pct": round(100.0 * (cpu1["aggregator"] - cpu0["aggregator"]) / wall, 1),
        "aggregator_cpu_ms_per_request": cpu_req.get("aggregator"),
        "views_per_s": round(views / wall, 1),
        "nats_msgs_per_s": {"in": round((bus1["server"][0] - bus0["server"][0]) / wall),
                            "out": round((bus1["server"][1] - bus0["server"][1]) / wall)},
        "cpu_pct": {k: round(100.0 * (cpu1[k] - cpu0[k]) / wall, 1) for k in cpu1},
        "cpu_ms_per_node_s": per_node_second({k: 100.0 * (cpu1[k] - cpu0[k]) / wall for k in cpu1}, prefill + decode),
        "cpu_split_pct": cpu_split({k: round(100.0 * (cpu1[k] - cpu0[k]) / wall, 1) for k in cpu1}),
        "cpu_ms_per_request": cpu_req, "loadavg": row["loadavg"], "cpu_pressure_pct": row["cpu_pressure_pct"],
    }


#: (label, how to read a row) of each cost whose growth is reported
COSTS = {
    "added p50 ms": lambda r: r["added_ms"]["p50"], "added p99 ms": lambda r: r["added_ms"]["p99"],
    "decision p50 ms": lambda r: r["decision_ms"]["p50"], "decision p99 ms": lambda r: r["decision_ms"]["p99"],
    "decision mean ms": lambda r: r["decision_ms"]["mean"],
    "dispatcher CPU ms/req": lambda r: r["dispatcher_cpu_ms_per_request"],
    "view age p99 ms": lambda r: r["state_age_ms"]["p99"], "aggregator CPU %": lambda r: r["aggregator_cpu_pct"],
    "views/s": lambda r: r["views_per_s"], "nats in msg/s": lambda r: r["nats_msgs_per_s"]["in"],
    "nats out msg/s": lambda r: r["nats_msgs_per_s"]["out"], "fleet CPU %": lambda r: r["cpu_pct"].get("fleet"),
}


def growth_table(rows: list[dict]) -> dict[str, float | None]:
    """Cost label → its value at the last row ÷ at the first (:data:`COSTS`)."""
    return {k: growth(f(rows[0]), f(rows[-1])) for k, f in COSTS.items()}


def targets(row: dict) -> dict[str, bool]:
    """The issue's targets at one row: added p50/p99, view age, failures."""
    a = row["added_ms"]
    return {"added_p50": a["p50"] is not None and a["p50"] <= TARGET_P50_MS,
            "added_p99": a["p99"] is not None and a["p99"] <= TARGET_P99_MS,
            "view_age": row["state_age_ms"]["over_3_periods"] == 0, "no_failures": row["failed"] == 0}


def print_table(rows: list[dict]) -> None:
    f = lambda x: "-" if x is None else f"{x:g}"  # noqa: E731
    print(f"{'cost':24}" + "".join(f"{r['size']:>12}" for r in rows) + f"{'growth':>10}", file=sys.stderr)
    g = growth_table(rows)
    for k, fn in COSTS.items():
        print(f"{k:24}" + "".join(f"{f(fn(r)):>12}" for r in rows) + f"{f(g[k]):>10}", file=sys.stderr)
    for label, fn in (("bus floor p50 ms", lambda r: (r.get("bus_floor_ms") or {}).get("p50")),
                      ("bus floor p99 ms", lambda r: (r.get("bus_floor_ms") or {}).get("p99")),
                      ("harness CPU %", lambda r: r["cpu_split_pct"]["harness"]),
                      ("control plane CPU %", lambda r: r["cpu_split_pct"]["control_plane"])):
        print(f"{label:24}" + "".join(f"{f(fn(r)):>12}" for r in rows), file=sys.stderr)
    print(f"{'failed':24}" + "".join(f"{r['failed']:>12}" for r in rows), file=sys.stderr)
    print(f"{'decisions >3 periods':24}" + "".join(f"{r['state_age_ms']['over_3_periods']:>12}" for r in rows),
          file=sys.stderr)
    fastest = max((k for k in g if g[k] is not None), key=lambda k: g[k], default=None)
    print(f"fastest-growing cost: {fastest} (x{g.get(fastest)})", file=sys.stderr)
    print(f"targets at {rows[-1]['size']}: {targets(rows[-1])}", file=sys.stderr)


def parse_sizes(text: str) -> list[tuple[int, int]]:
    """``"2x2,8x64"`` → ``[(2, 2), (8, 64)]`` (prefill, decode nodes). Raises argparse.ArgumentTypeError
    for anything but a comma list of PxD with P, D ≥ 1."""
    sizes = []
    for part in (x.strip() for x in text.split(",")):
        p, sep, d = part.lower().partition("x")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise argparse.ArgumentTypeError(f"{part!r} is not a size PxD with P, D >= 1 (e.g. 2x2,8x64,32x256)")
        sizes.append((int(p), int(d)))
    return sizes


def _positive(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number > 0")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number >= 0")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 1")
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--sizes", type=parse_sizes, default="2x2,8x64,32x256",
                    help="Comma list of PxD sizes (prefill x decode nodes).")
    ap.add_argument("--rate", type=_positive, default=100.0, help="Offered requests per second (> 0).")
    ap.add_argument("--duration", type=_positive, default=20.0, help="Seconds measured per size (> 0).")
    ap.add_argument("--warmup", type=_non_negative, default=2.0, help="Seconds sent before each measured run.")
    ap.add_argument("--floor-duration", type=_non_negative, default=10.0,
                    help="Seconds of bench/bus_floor.py before each size (0: skip the floor).")
    ap.add_argument("--prompt-tokens", type=_count, default=16)
    ap.add_argument("--output-tokens", type=_count, default=4)
    ap.add_argument("--per-process", type=_count, default=NODES_PER_PROCESS, help="Node agents per fleet process.")
    ap.add_argument("--json", default=None, help="Also write the rows (a JSON list) here.")
    # a fleet process (started by this script)
    ap.add_argument("--host-agents", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nats", help=argparse.SUPPRESS)
    ap.add_argument("--profile", help=argparse.SUPPRESS)
    ap.add_argument("--nodes", help=argparse.SUPPRESS)
    ap.add_argument("--slots", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host_agents:
        from kairos.runtime.service import run_on_event_loop  # uvloop, as a deployed agent (serve)

        run_on_event_loop(host_agents(args.nats, args.profile, args.nodes.split(","), args.slots), "fleet")
        return

    from kairos.core.model.latency import load_profile

    rows = []
    with tempfile.TemporaryDirectory(prefix="kairos-fleet-") as tmp:
        prof = cp.near_zero_profile(Path(tmp) / "near-zero.json")
        model = load_profile(prof)
        engine_ms = float(model.prefill_step_ms(args.prompt_tokens, 0) + model.decode_step_ms(1, args.prompt_tokens))
        for p, d in args.sizes:
            row = run_size(p, d, args, prof, engine_ms, Path(tmp))
            row["targets_met"] = targets(row)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
