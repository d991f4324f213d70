"""Blocks of the latency profiles (docs/calibration.md): what a fitted artifact
``kairos/core/data/profiles/<name>.json`` records about its own fit (``kairos profile``'s
provenance: held-out MAPE, steps, outliers, hardware) and what its model predicts, and how the
measured ``emulated-cpu`` compares with the ``a100-dsv2lite`` calibration it emulated.
"""

from __future__ import annotations

import json
from pathlib import Path

from tools.docgen.fmt import num
from tools.docgen.results import ROOT, DocgenError, Load


def profile_fit(load: Load, name: str) -> str:
    """Block ``profile-fit.<name>``: what the fitted artifact ``kairos/core/data/profiles/<name>.json`` records about
    its own fit (``kairos profile``'s provenance): held-out MAPE per model and the worst grid region (%),
    steps and seconds profiled, rejected outliers, engine and hardware."""
    path = ROOT / "kairos" / "core" / "data" / "profiles" / f"{name}.json"
    if not path.is_file():
        raise DocgenError(f"profile-fit.{name}: no {path.relative_to(ROOT)}")
    art = json.loads(path.read_text())
    meta = art.get("metadata", {})
    fit = meta.get("fit")
    if not fit:
        raise DocgenError(f"profile-fit.{name}: {path.name} records no fit (a calibration, not a measurement?)")
    worst_model, worst_region, worst = max(((m, reg, v["mape"]) for m, regs in fit["mape_regions"].items()
                                            for reg, v in regs.items()), key=lambda x: x[2])
    hw = meta.get("hardware", {})
    return (f"`{name}` ({meta.get('engine', '?')}, model {meta.get('model', '?')}, {hw.get('cores', '?')} cores "
            f"{hw.get('cpu', '')}, {meta.get('date', '?')[:10]}): held-out MAPE {art['prefill']['mape_heldout']:.1f} % "
            f"(prefill), {art['decode']['mape_heldout']:.1f} % (decode), {art['mixed_delta']['mape_heldout']:.1f} % "
            f"(mixed), per grid region up to {worst:.1f} % ({worst_model} steps with {worst_region}); "
            f"{num(meta.get('steps_recorded', 0))} steps in {meta.get('duration_s', 0):.0f} s, "
            f"{num(fit['rejected']['outlier'])} rejected as outliers{_load(meta)}.{_spread_and_predictions(path, meta)}")


def _load(meta: dict) -> str:
    """`` at load average B–A`` (1-minute, before and after the run) when the artifact records it."""
    la = meta.get("load_average") or {}
    before, after = (la.get("before") or [None])[0], (la.get("after") or [None])[0]
    return "" if before is None or after is None else f", load average {before:.1f} before and {after:.1f} after"


def _spread_and_predictions(path: Path, meta: dict) -> str:
    """The decode-step spread the artifact measured (its noise floor) and what its model predicts
    for a few steps (``LatencyModel.step_ms``, K = 600 tokens per decode; computed here)."""
    from kairos.core.model.latency import load_profile

    out = ""
    spread = meta.get("decode_spread")
    if spread:
        out += (f" Decode-only steps lie {spread['mape']:.1f} % (MAPE) from the median of the steps with the same "
                f"batch size ({num(spread['steps'])} steps, {num(spread['batch_sizes'])} batch sizes): the noise "
                f"floor no model of B and K can beat.")
    m = load_profile(str(path))

    def t(b: int, p: int) -> str:
        return f"{m.step_ms(b, 600 * b, p, 0.0):.1f}"

    return out + (f" It predicts decode-only B = 1 / 8 / 32 → {t(1, 0)} / {t(8, 0)} / {t(32, 0)} ms (K = 600 "
                  f"tokens per decode), a 512-token prefill alone {t(0, 512)} ms, a 512-token chunk with "
                  f"B = 1 / 8 / 32 decodes {t(1, 512)} / {t(8, 512)} / {t(32, 512)} ms.")


def emulated_cpu_fit(load: Load) -> str:
    """What the committed `emulated-cpu` artifact's own metadata says about its fit, and how its
    coefficients compare with the `a100-dsv2lite` calibration it emulated."""
    art = json.loads((ROOT / "kairos" / "core" / "data" / "profiles" / "emulated-cpu.json").read_text())
    ref = json.loads((ROOT / "kairos" / "core" / "data" / "profiles" / "a100-dsv2lite.json").read_text())
    meta, fit = art["metadata"], art["metadata"]["fit"]
    worst_model, worst_region, worst = max(((m, reg, v["mape"]) for m, regs in fit["mape_regions"].items()
                                            for reg, v in regs.items()), key=lambda x: x[2])

    def dev(a: float, b: float) -> float:
        return 100.0 * (a / b - 1.0)

    intercepts = {m: dev(art[m]["intercept_ms"], ref[m]["intercept_ms"]) for m in ("prefill", "decode")}
    slopes = {f"{m} `{f}`": dev(a, b) for m in ("prefill", "decode", "mixed_delta")
              for f, a, b in zip(art[m]["features"], art[m]["coef"], ref[m]["coef"])}
    big = {k: v for k, v in slopes.items() if abs(v) >= 5.0}
    small = max(abs(v) for k, v in slopes.items() if k not in big)
    return (f"What it shows: the profiler and the fit recover a node's step times through the whole bus path "
            f"with held-out MAPE of {art['prefill']['mape_heldout']:.2f} % (prefill), "
            f"{art['decode']['mape_heldout']:.2f} % (decode) and {art['mixed_delta']['mape_heldout']:.2f} % (mixed), "
            f"per grid region up to {worst:.2f} % ({worst_model} steps with {worst_region}), from "
            f"{num(meta['steps_recorded'])} steps in {meta['duration_s']:.0f} s; "
            f"{num(fit['rejected']['outlier'])} training steps were rejected as outliers (late wake-ups). Against "
            f"`a100-dsv2lite`'s coefficients: intercepts prefill {intercepts['prefill']:+.1f} %, decode "
            f"{intercepts['decode']:+.1f} % (the event-loop lateness added to every step); every other coefficient "
            f"within ±{small:.1f} %"
            + "".join(f", except {k} ({v:+.0f} %, from {num(fit['samples']['prefill'])} prefill-only steps)"
                      if k.startswith("prefill") else f", except {k} ({v:+.0f} %)" for k, v in big.items())
            + " — as they should be for the emulated engine (its metadata records all of this).")
