"""``kairos demo`` (the README's main command): bring the whole stack up on emulated engines,
replay a busy window of a real trace through the ingress with streaming requests, print the
results beside the simulator's for the same workload, shut everything down.

Everything it runs is the product: ``kairos up``'s supervisor, ``kairos bench``'s client and
``kairos sim``'s simulator, with one workload.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

from kairos.up import Supervisor, UpOptions, free_port


def simulate_same(workload: str, rps: float | None, duration: float, seed: int, opts: UpOptions) -> dict[str, Any]:
    """The simulator's row for the workload the live run replayed (same policy and parameters)."""
    from shared.latency import load_profile
    from shared.policy import PolicyParams, parse_policy
    from shared.workloads import parse_workload
    from sim.experiments import run_one
    from sim.simulator import SimConfig

    model = load_profile(opts.profile)
    params = PolicyParams(alpha=opts.alpha, beta=opts.beta, tbt_slo_ms=opts.tbt_slo_ms, ttft_slo_ms=opts.ttft_slo_ms)
    wl = parse_workload(workload, rps, duration, seed, max_model_len=model.engine.max_model_len)
    policy = parse_policy(opts.policy)
    cfg = SimConfig(n_prefill=opts.prefill, n_decode=opts.decode, heartbeat_ms=opts.state_period_ms,
                    tbt_guard=policy.name == "kairos+",  # kairos up turns the node-side guard on for kairos+
                    truth_scale=opts.truth_scale)
    return run_one(wl, policy, model, params, cfg, rps=rps, label="simulated")


#: live/sim ratio band the demo states and flags (README "Fidelity": ±15 % on TTFT P50 and P95)
FIDELITY_TOLERANCE = 0.15


def side_by_side(live: dict[str, Any], simulated: dict[str, Any], tolerance: float = FIDELITY_TOLERANCE) -> str:
    """A fidelity table: live vs simulated TTFT P50/P95 (and its P95 components), TBT P50, TBT
    violations (% of steps / gaps > τ), SLO attainment (%) and deflections, with their ratio; a
    ratio outside ``1 ± tolerance`` is marked ``<-- outside ±15 %`` (for the default tolerance).

    Both sides are :func:`shared.metrics.summarize` dicts. The simulator counts TBT violations per
    engine decode step, the live client per inter-token gap it saw (the only thing a client can
    measure), so that row compares two definitions of the same SLO; it is flagged like the others.
    """
    rows = [("", "live", "simulator", "live/sim", "")]
    lb, sb = live.get("ttft_breakdown_p95_ms") or {}, simulated.get("ttft_breakdown_p95_ms") or {}

    def pct(d: dict[str, Any], key: str) -> float | None:
        v = d.get(key)
        return None if v is None else 100.0 * v

    flag = f"<-- outside ±{tolerance * 100:g} %"
    for name, a, b, spec in (
            ("TTFT p50 ms", live["ttft_ms"]["p50"], simulated["ttft_ms"]["p50"], ",.0f"),
            ("TTFT p95 ms", live["ttft_ms"]["p95"], simulated["ttft_ms"]["p95"], ",.0f"),
            *((f"  p95 {k.replace('_', ' ')} ms", lb.get(k), sb.get(k), ",.0f")
              for k in ("prefill_queue", "prefill_exec", "kv_transfer", "decode_queue")),
            ("TBT p50 ms", live["tbt_ms"]["p50"], simulated["tbt_ms"]["p50"], ",.0f"),
            ("TBT violations %", pct(live, "tbt_violation_rate"), pct(simulated, "tbt_violation_rate"), ".2f"),
            ("SLO attainment %", pct(live, "slo_attainment"), pct(simulated, "slo_attainment"), ".1f"),
            ("deflections", live["deflections"], simulated["deflections"], ",.0f")):
        num = isinstance(a, (int, float)) and isinstance(b, (int, float))
        ratio = a / b if num and b else None
        off = ratio is not None and abs(ratio - 1.0) > tolerance
        rows.append((name, "-" if a is None else format(a, spec), "-" if b is None else format(b, spec),
                     "-" if ratio is None else f"{ratio:.2f}", flag if off else ""))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(("  " + "  ".join(r[i].rjust(w[i]) if i else r[i].ljust(w[i]) for i in range(4))
                      + (f"  {r[4]}" if r[4] else "")) for r in rows)


def run_demo(opts: UpOptions, *, workload: str, rps: float | None, duration: float, seed: int,
             json_path: str | None, progress: bool) -> int:
    """Up → bench → compare → down. Returns the exit code (0 when every request completed)."""
    from kairos.bench import BenchError, bench_cli

    sup = Supervisor(opts)

    def on_signal(signum, _frame) -> None:
        sup.stopping = True
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sup.msg(f"starting {opts.prefill}P{opts.decode}D with policy {opts.policy} ...")
        sup.up()
        print(sup.table(), flush=True)
        print(f"\nReplaying {workload} ({duration:g} s) against http://{opts.host}:{opts.port} ...", flush=True)
        report = bench_cli(url=f"http://{opts.host}:{opts.port}", workload=workload, rps=rps, duration=duration,
                           seed=seed, model=None, max_concurrency=None, request_timeout=300.0, max_model_len=None,
                           label=f"live {opts.policy}", json_path=json_path, save_records=False, progress=progress,
                           tbt_slo_ms=opts.tbt_slo_ms, ttft_slo_ms=opts.ttft_slo_ms)
        sim_row = simulate_same(workload, rps, duration, seed, opts)
        if json_path:  # the live report (written by bench_cli) gains the simulator's row beside it
            Path(json_path).write_text(json.dumps({**report, "simulated": sim_row}, indent=2) + "\n")
        print("\nSame workload through the simulator (kairos sim), side by side:")
        print(side_by_side(report, sim_row), flush=True)
        lost = report["sent"] - report["completed"] - report["failed"]
        print(f"\n{report['completed']}/{report['sent']} completed, {report['failed']} failed, {lost} lost; "
              f"{report['deflections']} deflections. The demo stack stops now; to keep one running and see "
              f"any request's decision: kairos up, then curl http://127.0.0.1:8000/v1/requests/<id>")
        return 0 if report["failed"] == 0 and lost == 0 else 1
    except BenchError as exc:
        sup.msg(f"bench: {exc}")
        return 2
    except KeyboardInterrupt:
        sup.msg("interrupted")
        return 130
    except RuntimeError as exc:
        sup.failed = True
        sup.msg(f"startup failed: {exc}")
        return 1
    finally:
        try:
            sup.msg("stopping")
            sup.finish()  # down, remove the temp dir (kept with its logs if startup failed), "stopped"
        finally:
            for s, h in old.items():
                signal.signal(s, h)


def progress_default(explicit: bool | None) -> bool:
    """``--progress/--no-progress`` when given, else on: the bench client shows a bar on a terminal
    and one line every 10 s otherwise (a redirected tqdm bar would be one line per refresh)."""
    return True if explicit is None else explicit


#: ``kairos demo --engine vllm``: 1P1D on the CPU testbed (docs/vllm.md "The CPU testbed": each
#: engine's whole server on its own core, the quiet-idle plugin, the ``testbed`` random-weight model and
#: its measured ``cpu-testbed-vllm`` profile), a minute of the Bursty mix (prompts capped at the model's
#: 2,048-token context) at 1 request/s, which keeps the prefill engine the bottleneck while the decode
#: engine has slack; a TBT SLO above the testbed's decode steps (decode-only steps up to B = 32 fit in
#: it) and one dispatcher (cores are scarce)
VLLM_DEMO = {"workload": "bursty", "rps": 1.0, "duration": 60.0, "prefill": 1, "decode": 1, "dispatchers": 1,
             "tbt_slo_ms": 100.0, "ttft_slo_ms": 5000.0, "model_size": "testbed"}


#: ``kairos demo`` (``make run``) on emulated engines: the busiest minute of the Azure code trace at its own
#: timing, 2P2D
EMULATED_DEMO = {"workload": "azure-code:busiest", "rps": None, "duration": 60.0, "prefill": 2, "decode": 2}


def demo_command(**o) -> None:
    """Thin click body (see kairos/cli.py); fills the engine-dependent defaults."""
    vllm = o.get("engine") == "vllm"
    dflt = VLLM_DEMO if vllm else EMULATED_DEMO
    for key in ("workload", "duration", "prefill", "decode"):
        if o.get(key) is None:
            o[key] = dflt[key]
    rps = o["rps"] if o["rps"] is not None or o["workload"] != dflt["workload"] else dflt["rps"]
    extra: dict[str, Any] = {}
    if vllm:
        from kairos.engines import cached_tiny_model
        from kairos.up import VLLM_DEFAULTS

        model_dir = o.get("model_dir")
        if model_dir is None:
            print(f"kairos demo: the {VLLM_DEMO['model_size']} random-weight model (generated once into the cache) ...",
                  file=sys.stderr, flush=True)
            model_dir = cached_tiny_model(size=VLLM_DEMO["model_size"])
        extra = {"engine": "vllm", "model_dir": model_dir, "served_model": VLLM_DEFAULTS["served_model"],
                 "startup_timeout_s": VLLM_DEFAULTS["startup_timeout_s"], "tbt_slo_ms": VLLM_DEMO["tbt_slo_ms"],
                 "ttft_slo_ms": VLLM_DEMO["ttft_slo_ms"],
                 "dispatchers": VLLM_DEMO["dispatchers"] if o["dispatchers"] == 2 else o["dispatchers"]}
    opts = UpOptions(**{"port": o["port"] or free_port(), "policy": o["policy"], "profile": o["profile"],
                        "prefill": o["prefill"], "decode": o["decode"], "dispatchers": o["dispatchers"],
                        "trace_file": o["trace_file"], "truth_scale": o.get("truth_scale", 1.0), **extra})
    sys.exit(run_demo(opts, workload=o["workload"], rps=rps, duration=o["duration"], seed=o["seed"],
                      json_path=o["json_path"], progress=progress_default(o["progress"])))


__all__ = ["run_demo", "demo_command", "progress_default", "side_by_side", "simulate_same"]
