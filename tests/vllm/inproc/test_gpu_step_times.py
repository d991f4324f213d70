"""bench/gpu_step_times.py on CPU (``--device cpu --smoke``): the packed step computes what transformers computes,
the recorded rows carry what the step-model fit needs, and the fit reports MAPE on held-out rows only.

Runs under the vLLM venv (torch + transformers; ``.venv`` has neither). That venv has no scikit-learn, so the
smoke run records steps only, and the refit runs with Kairos's ``.venv`` python (skipped where there is none).
"""

from __future__ import annotations

import collections
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tools.docgen.docgen import load_result

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "bench" / "gpu_step_times.py"
sys.path.insert(0, str(SCRIPT.parent))
import gpu_step_times as gst  # noqa: E402


@pytest.fixture(scope="module")
def smoke_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gst") / "smoke.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def test_packed_step_matches_transformers_forward():
    """One mixed step (a chunk after a cached prefix + 2 decodes) gives transformers' logits for each sequence;
    a wrong decode position, causal mask or KV-head grouping gives 3e-3 to 0.2 here (seen by breaking each)."""
    import torch

    model = gst.build_model("smoke", "cpu", torch.float32)
    assert gst.check_against_transformers(model) < 1e-5
    assert gst.check_against_transformers(model, c=0, p=9, b=3, ctx=4) < 1e-5  # no prefix; another batch


def test_smoke_rows_carry_what_the_fit_needs(smoke_file):
    res = load_result(smoke_file.stem, smoke_file.parent)
    assert {"command", "date", "machine", "loadavg_1m", "commit"} <= set(res.meta)
    assert "--smoke" in res.meta["command"]
    (config,) = res.where(row="config")
    assert config["arch"] == "smoke" and config["points_measured"] == config["points_planned"]
    steps = res.where(row="step")
    grid = gst.GRIDS["smoke"]
    assert sorted((r["batch_size"], r["context_per_decode"], r["prefill_tokens"], r["prefill_cached"]) for r in steps) \
        == sorted(grid.points(0))
    for r in steps:
        kind = "prefill" if r["batch_size"] == 0 else "decode" if r["prefill_tokens"] == 0 else "mixed"
        assert r["kind"] == kind
        assert r["kv_tokens"] == r["batch_size"] * r["context_per_decode"]
        assert 0 < r["min_ms"] <= r["latency_ms"] <= r["max_ms"] and r["repeats"] == 5
    counts = collections.Counter(r["kind"] for r in steps)
    assert min(counts[k] for k in ("prefill", "decode", "mixed")) >= 5  # fit_latency_model's minimum per kind


def _kairos_python() -> Path | None:
    for py in (ROOT / ".venv" / "bin" / "python",):
        if py.is_file():
            ok = subprocess.run([str(py), "-c", "import sklearn"], capture_output=True).returncode == 0
            if ok:
                return py
    return None


def test_refit_reports_heldout_mape_only(smoke_file):
    py = _kairos_python()
    if py is None:
        pytest.skip("no Kairos .venv with scikit-learn to fit with")
    for _ in range(2):  # a refit replaces the fit rows, never appends
        proc = subprocess.run([str(py), str(SCRIPT), "--refit", str(smoke_file)], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    res = load_result(smoke_file.stem, smoke_file.parent)
    counts = collections.Counter(r["kind"] for r in res.where(row="step"))
    fits = {r["kind"]: r for r in res.where(row="fit")}
    assert sorted(fits) == ["decode", "mixed", "prefill"] and len(res.where(row="fit")) == 3
    for kind, f in fits.items():
        assert f["samples"] == counts[kind]
        # sklearn's train_test_split(test_size=0.2) holds out ceil(0.2 n) rows; the MAPE is over those only
        assert f["heldout"] == math.ceil(0.2 * counts[kind]) < counts[kind]
        assert math.isfinite(f["mape_heldout"]) and f["mape_heldout"] >= 0
    assert "refit_command" in res.meta and res.meta["command"].endswith(f"--out {smoke_file}")
