"""Profiling plan and artifact provenance for ``kairos profile`` (no I/O; the service is
``kairos/services/profiler``).

The §3.2 grid, driven on one decode node (its engine runs all three step kinds):

* **mixed steps** — for each decode batch ``B`` and context per decode ``ctx`` (so ``K ≈ B·ctx``),
  ``B`` background decodes are started on the node; then, for each chunk size χ, one deflected
  prefill of ``chunk_steps × (χ − B)`` prompt tokens with the schedule ``[χ] × chunk_steps`` runs
  five successive chunks: steps with ``p = χ − B`` new tokens after ``c = 0, p, 2p, …`` cached.
* **decode-only steps** — every step of the background decodes without a chunk
  (``decode_dwell_steps`` of them before the first chunk of each batch).
* **prefill-only steps with a cached prefix** — on the idle node, a deflected prefill of
  ``chunk_steps × χ`` tokens with ``[χ] × chunk_steps``: ``n = χ`` after ``c = 0, χ, 2χ, …``.

Where the samples go: :func:`kairos.core.model.fitting.fit_latency_model` (via :func:`step_records`), and the
artifact's ``metadata`` (:func:`provenance`).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

import numpy as np

from kairos.core.model.fitting import StepRecord
from kairos.core.model.latency import LatencyModel
from kairos.contracts.wire import StepRecordEvent


@dataclass(frozen=True)
class ProfileGrid:
    """The profiling grid (token counts in tokens).

    Attributes:
        batch_sizes: decode batches B with background decodes (mixed and decode-only steps).
        contexts: context tokens per background decode (K ≈ B × ctx).
        chunks: chunk sizes χ of the mixed steps (total step tokens incl. the B decode tokens).
        prefill_chunks: chunk sizes n of the prefill-only steps.
        chunk_steps: successive chunks per measurement (§3.2: five).
        decode_dwell_steps: decode-only steps recorded per batch before its first chunk.
        repeats: each chunked prefill (prefill-only and mixed) is measured this many times (more
            samples per grid point where single steps are noisy, e.g. on a shared CPU).
        mixed_prefixes: computed prompt tokens before the measured chunks of a mixed run (0: the
            chunks start the prompt). A prefix P > 0 is run first in steps of
            :data:`PREFIX_STEP_TOKENS` (χ incl. the B decodes: mixed samples too), so the measured
            chunks attend over P + earlier chunks' tokens — the long-context chunks a deflected
            long prompt ends with.

    A prefill-only run whose ``chunk_steps × n`` prompt exceeds the node's context is shortened to
    the context (less one output token) while a second chunk follows the first, so a chunk the size
    of the step budget is measured with and without a computed prefix.
    """

    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]
    prefill_chunks: tuple[int, ...]
    chunk_steps: int = 5
    decode_dwell_steps: int = 8
    repeats: int = 1
    mixed_prefixes: tuple[int, ...] = (0,)

    def mixed_plan(self) -> list[tuple[int, int, list[int]]]:
        """(B, ctx, χ values with χ > B) per background batch; batches with no such χ are left out."""
        out = []
        for b in self.batch_sizes:
            for ctx in self.contexts:
                chis = [c for c in self.chunks if c > b]
                if chis:
                    out.append((b, ctx, chis))
        return out

    def steps_planned(self) -> int:
        """Chunk steps the plan runs (mixed + prefill-only), excluding decode-only steps."""
        mixed = sum(len(chis) for _, _, chis in self.mixed_plan())
        return (mixed * len(self.mixed_prefixes) + len(self.prefill_chunks)) * self.chunk_steps * self.repeats


#: step size (χ, tokens incl. the B decodes) of a mixed run's computed prefix (ProfileGrid.mixed_prefixes)
PREFIX_STEP_TOKENS = 512


def prefix_schedule(prefix: int, batch: int) -> list[int]:
    """The chunk schedule (χ per step, incl. ``batch`` decode tokens) that computes ``prefix`` prompt
    tokens in steps of :data:`PREFIX_STEP_TOKENS` (a vLLM node runs χ − B prompt tokens per step);
    ``[]`` for no prefix. Raises ValueError when a step would compute nothing (B ≥ the step size)."""
    if prefix <= 0:
        return []
    per = PREFIX_STEP_TOKENS - batch
    if per <= 0:
        raise ValueError(f"a prefix step of {PREFIX_STEP_TOKENS} tokens computes nothing beside {batch} decodes")
    steps, last = divmod(prefix, per)
    return [PREFIX_STEP_TOKENS] * steps + ([last + batch] if last else [])


#: ``quick``: the CI round trip and the README (~15 s on the emulated default profile);
#: ``paper``: the §3.2 grid (B up to 128, 8K context tokens per decode, χ 128…2048; batches that do not fit
#: the node's free KV are skipped);
#: ``cpu-tiny``: vLLM-CPU with the tiny model (``kairos profile --vllm``): every request fits its 2,048-token
#: context (three chunks of ≤ 512 prompt tokens; background decodes of 256 or 1,024 context tokens plus
#: ≤ 1,024 output tokens), B ≤ 32 (the deflected request needs one of the 64 running slots), χ ≤ 512 (the
#: 1,024-token step budget); its CPU step times are ~1–40 ms, so the grid runs in about a minute;
#: ``cpu-testbed``: the CPU testbed (``kairos profile --vllm``'s default): the region the testbed's
#: live steps run in — decodes of up to ~2,000 context tokens, prefill chunks up to the 1,024-token
#: step budget with and without a computed prefix, mixed chunks after a 1,280-token prefix (a long
#: deflected prompt's last chunks); ``cpu-tiny`` covers only contexts ≤ 1,024 and chunks ≤ 512;
#: ``cpu-tiny-ci``: the same engine's smallest fittable grid (the vLLM test tier's round trip).
GRIDS: dict[str, ProfileGrid] = {
    "quick": ProfileGrid(batch_sizes=(4, 16), contexts=(1024,), chunks=(256, 512, 1024),
                         prefill_chunks=(256, 512, 1024, 2048)),
    "paper": ProfileGrid(batch_sizes=(1, 8, 32, 64, 128), contexts=(512, 2048, 8192),
                         chunks=(128, 256, 512, 1024, 2048), prefill_chunks=(128, 256, 512, 1024, 2048)),
    "cpu-tiny": ProfileGrid(batch_sizes=(1, 4, 16, 32), contexts=(256, 1024), chunks=(128, 256, 512),
                            prefill_chunks=(32, 64, 128, 192, 256, 384, 512), chunk_steps=3, decode_dwell_steps=8,
                            repeats=3),
    "cpu-testbed": ProfileGrid(batch_sizes=(1, 4, 16, 32), contexts=(256, 1024, 1792), chunks=(128, 256, 512),
                               prefill_chunks=(64, 128, 256, 512, 768, 1024), chunk_steps=3, decode_dwell_steps=8,
                               repeats=2, mixed_prefixes=(0, 1280)),
    "cpu-tiny-ci": ProfileGrid(batch_sizes=(2, 8), contexts=(256,), chunks=(128, 384), prefill_chunks=(64, 256, 512),
                               chunk_steps=3, decode_dwell_steps=8),
}


def step_records(events: Iterable[StepRecordEvent]) -> list[StepRecord]:
    """Fitting samples from step records (wall time as the latency; no filtering here — the fit's
    hygiene rejects and counts bad samples)."""
    return [StepRecord(e.batch_size, e.kv_tokens, e.prefill_tokens, int(round(e.prefill_cached)), e.wall_ms)
            for e in events]


def warmup_steps(events: Iterable[StepRecordEvent]) -> set[int]:
    """Step numbers of the first step of each prefill composition — (B, p) with p > 0 prompt
    tokens — in a run, in step order. A real engine pays for a new step shape once (kernel
    selection and caching: vLLM-CPU's first step of a shape takes several times as long as its
    repeats, as the records of ``kairos profile --vllm --records`` show), which a warmed serving
    engine does not pay again; the fit leaves these steps out, train and held-out alike
    (``metadata.warmup_steps``; docs/calibration.md "Warm-up steps").
    Decode-only steps show no such cost and are all kept."""
    seen: set[tuple[int, int]] = set()
    first: set[int] = set()
    for e in sorted(events, key=lambda e: e.step):
        if e.prefill_tokens > 0 and (e.batch_size, e.prefill_tokens) not in seen:
            seen.add((e.batch_size, e.prefill_tokens))
            first.add(e.step)
    return first


def decode_spread(events: Iterable[StepRecordEvent], min_steps: int = 5) -> dict[str, Any]:
    """How noisy the node's steps were: the MAPE (percent) of each decode-only step's wall time
    against the median of the decode-only steps with the same batch size B (groups of at least
    ``min_steps``), over all those steps. A model of B and K cannot get much below this on these
    samples (K varies little within a group), so it is the floor to read a decode MAPE against.

    Returns ``{"mape": float | None, "steps": int, "batch_sizes": int}`` (None: no group large enough).
    """
    groups: dict[int, list[float]] = {}
    for e in events:
        if e.prefill_tokens == 0 and e.batch_size > 0 and e.wall_ms > 0:
            groups.setdefault(e.batch_size, []).append(e.wall_ms)
    errs: list[float] = []
    used = 0
    for walls in groups.values():
        if len(walls) >= min_steps:
            med = float(np.median(walls))
            errs += [abs(w - med) / w for w in walls]
            used += 1
    return {"mape": round(100.0 * float(np.mean(errs)), 2) if errs else None, "steps": len(errs), "batch_sizes": used}


def hardware() -> dict[str, Any]:
    """This host: CPU model, cores, machine, OS (what an artifact was measured on)."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "machine": platform.machine(), "os": platform.platform()}


def provenance(*, node: str, grid_name: str, grid: ProfileGrid | None, events: list[StepRecordEvent], engine: str,
               served_model: str, label: str, started_unix_ms: float, finished_unix_ms: float,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The artifact's ``metadata``: where, on what and how it was measured.

    ``label`` is the human statement of what the artifact is (e.g. "emulated engine under CPU
    load, not a real engine"); ``engine`` the backend (``emulated``, ``vllm x.y``); ``grid`` None for
    steps that no grid planned (``kairos profile --testbed``'s replay).
    """
    versions = sorted({e.model_version for e in events if e.model_version})
    return {
        "provenance": "kairos profile",
        "label": label,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hardware": hardware(),
        "engine": engine,
        "model": served_model,
        "node": node,
        "node_model_versions": versions,
        "grid": {"name": grid_name, **(asdict(grid) if grid is not None else {})},
        "steps_recorded": len(events),
        "duration_s": round((finished_unix_ms - started_unix_ms) / 1000.0, 1),
        **(extra or {}),
    }


def default_version() -> str:
    """A sortable version string: the UTC time of the fit (``20261130T134501Z``)."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def fit_summary(model: LatencyModel) -> str:
    """Human-readable fit report: held-out MAPE per model and per grid region, samples, rejections."""
    fit = model.metadata.get("fit", {})
    lines = [f"latency model {model.artifact_version}"]
    rej = fit.get("rejected", {})
    lines.append(f"  samples {fit.get('samples', {})}; rejected: {rej.get('invalid', 0)} invalid, "
                 f"{rej.get('outlier', 0)} outliers ({fit.get('outlier_rule', '')})")
    if model.metadata.get("warmup_steps"):
        lines.append(f"  left out: {model.metadata['warmup_steps']} warm-up steps (the first step of each prefill "
                     "composition B, p)")
    for kind in ("prefill", "decode", "mixed"):
        m = model.mape.get(kind)
        lines.append(f"  {kind:8s} held-out MAPE {'–' if m is None else f'{m:.2f} %'}")
        for region, v in fit.get("mape_regions", {}).get(kind, {}).items():
            lines.append(f"      {region:22s} {v['mape']:7.2f} %  ({v['rows']} rows)")
    spread = model.metadata.get("decode_spread") or {}
    if spread.get("mape") is not None:
        lines.append(f"  noise: decode-only steps lie {spread['mape']:.2f} % (MAPE) from the median of their batch size "
                     f"({spread['steps']} steps, {spread['batch_sizes']} batch sizes)")
    load = model.metadata.get("load_average")
    if load:
        lines.append(f"  load average (1, 5, 15 min): before {load['before']}, after {load['after']}")
    return "\n".join(lines)
