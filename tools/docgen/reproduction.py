"""Generate ``docs/results/paper-reproduction.md``: our Table 3, Table 4, §6 sweep and the kairos+
ablations beside the paper's numbers, for both link settings.

    python -m tools.docgen.reproduction [--out docs/results] [--duration 600] [--seed 1]

Everything in the report is computed by this one run (:mod:`tools.docgen.repro_experiments`);
nothing is typed in by hand except the paper's published figures (:mod:`tools.docgen.paper`). The
prose (tools/docgen/templates/report_template.md, tools/docgen/templates/report_notes.md) holds no
figure of its own: every number in it is a ``{placeholder}`` filled from this run's rows
(:func:`tools.docgen.repro_facts.note_facts`) or from :func:`template_values`, and
tests/unit/test_report_prose.py fails on a digit outside a placeholder.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path
from typing import Any

from kairos.core.model.correction import CorrectionEstimator
from kairos.core.model.latency import load_profile
from kairos.core.policy import PolicyParams
from kairos.core.policy.taichi import DEFAULT_DECODE_CHUNK
from kairos.core.workload.workloads import MOONCAKE_BLOCK_TOKENS, generate
from kairos.sim.simulator import SimConfig
from tools.docgen.paper import PAPER_RPS
from tools.docgen.repro_experiments import (ABLATION_RATES, CONV_POLICIES, LINKS, LOAD_MATCH, NORMALIZED_RATES, PAPER_RATES,
                                            ROBUST_NOISE, ablation, conversation, load_matched_rps, model_error,
                                            model_error_scenarios, oracle_check, prefill_capacity_tok_s, robustness,
                                            speed, sweep6, table3, table4)
from tools.docgen.repro_facts import note_facts

TEMPLATES = Path(__file__).parent / "templates"

def read_notes(path: Path, facts: dict[str, str] | None = None) -> dict[str, str]:
    """Prose sections of the report: ``<!-- name -->`` starts section ``name``; with ``facts`` each
    section's ``{placeholders}`` are filled from it (KeyError names a missing one)."""
    parts = re.split(r"^<!-- (\w+) -->\s*$", path.read_text(), flags=re.M)
    notes = {parts[i]: parts[i + 1].strip() for i in range(1, len(parts) - 1, 2)}
    return {k: v.format(**facts) for k, v in notes.items()} if facts is not None else notes



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of workload per run")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    params = PolicyParams()
    t0 = time.perf_counter()
    sections: dict[str, Any] = {}
    data: dict[str, Any] = {}
    sections["t3m"], data["table3-load-matched-paper"] = table3(args.duration, args.seed, "paper", params,
                                                               utilization=LOAD_MATCH)
    for link in LINKS:
        sections[f"t3-{link}"], data[f"table3-{link}"] = table3(args.duration, args.seed, link, params)
        sections[f"t4-{link}"], data[f"table4-{link}"] = table4(args.duration, args.seed, link, params)
        sections[f"s6-{link}"], data[f"sweep-{link}"], plots = sweep6(args.duration, args.seed, link, params, out)
        sections[f"plots-{link}"] = "\n".join(f"![{p.stem}](plots/{p.name})" for p in plots)
        sections[f"s6n-{link}"], data[f"sweep-normalized-{link}"], plots = sweep6(
            args.duration, args.seed, link, params, out, rates=NORMALIZED_RATES, tag="-normalized")
        sections[f"plotsn-{link}"] = "\n".join(f"![{p.stem}](plots/{p.name})" for p in plots)
        sections[f"abl-{link}"], data[f"ablation-{link}"] = ablation(args.duration, args.seed, link, params)
    sections["robust"], data["robustness"] = robustness(args.duration, args.seed, params)
    sections["model_error"], data["model-error"], sections["model_error_targets"] = model_error(
        args.duration, args.seed, params)
    sections["conversation"], data["conversation"], sections["conversation_targets"] = conversation(
        args.duration, args.seed, params)
    sections["oracle"] = oracle_check(args.duration, args.seed, params)
    sections["speed"] = speed(args.seed, params)
    (out / "paper-reproduction.json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data, sections, params, args.duration, args.seed, time.perf_counter() - t0)
    (out / "paper-reproduction.md").write_text(text)
    print(f"wrote {out / 'paper-reproduction.md'} in {time.perf_counter() - t0:.0f} s")



def template_values(params: PolicyParams, duration: float, seed: int, wall_s: float) -> dict[str, Any]:
    """The run-level placeholders of tools/docgen/templates/report_template.md (settings, links, capacity)."""
    model = load_profile()
    bursty = generate("bursty", 50, 200, seed)
    cfg = SimConfig()
    scen = model_error_scenarios(duration)
    return dict(
        duration=duration, seed=seed, wall=wall_s, machine=f"{platform.machine()}, Python {platform.python_version()}",
        paper_link=f"{model.link('paper').bandwidth_gb_s} GB/s + {model.link('paper').setup_ms} ms",
        rdma_link=f"{model.link('rdma').bandwidth_gb_s} GB/s + {model.link('rdma').setup_ms} ms",
        profile=model.artifact_version, capacity=f"{prefill_capacity_tok_s():,.0f}",
        matched=", ".join(f"{w.upper()} {load_matched_rps(w, LOAD_MATCH, seed):g}" for w in PAPER_RPS),
        cluster=f"{cfg.n_prefill}P{cfg.n_decode}D", n_prefill=cfg.n_prefill, n_decode=cfg.n_decode,
        heartbeat=f"{cfg.heartbeat_ms:g}", load_match=f"{100 * LOAD_MATCH:g} %",
        bursty_mean=f"{sum(r.prompt_tokens for r in bursty) / len(bursty):,.0f}",
        t4_rps=f"{PAPER_RPS['bursty']:g}", tau=f"{params.tbt_slo_ms:g}", ttft_slo=f"{params.ttft_slo_ms / 1000:g}",
        paper_rates=f"{min(PAPER_RATES):g}–{max(PAPER_RATES):g}",
        me_bias=f"×{scen[1][1]['truth_scale']:g} or ×{scen[2][1]['truth_scale']:g}",
        me_noise=f"σ = {100 * scen[3][1]['noise']:g} %",
        me_drift=f"{scen[-1][1]['drift_node']} {100 * (scen[-1][1]['drift_scale'] - 1):g} % slower from "
                 f"{scen[-1][1]['drift_at_s']:g} s on",
        corr_window=f"{CorrectionEstimator().window_ms / 1000:g}", corr_min=f"{CorrectionEstimator().min_samples}",
        corr_q=f"{100 * CorrectionEstimator().quantile:g} %",
        norm_rates=f"{min(NORMALIZED_RATES):g}–{max(NORMALIZED_RATES):g}",
        abl_rates=" and ".join(f"{r:g}" for r in ABLATION_RATES),
        noise_levels=", ".join(f"{n:g}" for n in ROBUST_NOISE), d_chunk=f"{DEFAULT_DECODE_CHUNK:,}",
        p_chunk=f"{params.prefill_chunk_tokens:,}", flow=f"{params.flow_tpot_fraction:g}",
        conv_policies=", ".join(f"`{p}`" for p in CONV_POLICIES), mooncake_block=f"{MOONCAKE_BLOCK_TOKENS:g}",
    )



def render(data: dict[str, Any], sections: dict[str, str], params: PolicyParams, duration: float, seed: int,
           wall_s: float) -> str:
    """Fill the template: generated sections, the notes (their figures from :func:`note_facts`)
    and the run-level values."""
    template = (TEMPLATES / "report_template.md").read_text()
    values = template_values(params, duration, seed, wall_s)
    notes = read_notes(TEMPLATES / "report_notes.md", {**values, **note_facts(data, params, seed)})
    return template.format(**sections, **notes, **values)



if __name__ == "__main__":
    main()
