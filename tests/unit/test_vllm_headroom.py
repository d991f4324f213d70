"""bench/vllm_headroom.py: the profile scaled to measured step times, and reading the A/B's scales."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from vllm_headroom import measured_scales, scaled_model  # noqa: E402

from kairos.core.model.latency import load_profile  # noqa: E402


def test_prefill_and_decode_node_step_times_scale_separately():
    base = load_profile("cpu-testbed-vllm")
    m = scaled_model(base, prefill=2.0, decode=1.5)
    assert m.step_ms(0, 0, 512, 0) == pytest.approx(2.0 * base.step_ms(0, 0, 512, 0))  # prefill-only step
    assert m.step_ms(8, 4800, 0, 0) == pytest.approx(1.5 * base.step_ms(8, 4800, 0, 0))  # decode-only step
    assert m.step_ms(8, 4800, 256, 0) == pytest.approx(1.5 * base.step_ms(8, 4800, 256, 0))  # mixed step
    assert m.kv_transfer_ms(1000) == base.kv_transfer_ms(1000) and m.engine == base.engine
    with pytest.raises(ValueError, match="scales must be > 0"):
        scaled_model(base, prefill=0.0, decode=1.0)


def test_measured_scales_come_from_the_kairos_row(tmp_path):
    ab = tmp_path / "ab.jsonl"
    ab.write_text("\n".join(json.dumps(x) for x in [
        {"meta": {"command": "python bench/vllm_ab.py"}}, {"policy": "pd", "step_scale": {"decode-0": 1.1}},
        {"policy": "kairos", "step_scale": {"prefill-0": 1.3, "decode-0": 1.2}}]) + "\n")
    assert measured_scales(ab) == {"prefill-0": 1.3, "decode-0": 1.2}
    with pytest.raises(ValueError, match="no step_scale recorded for policy 'kairos\\+'"):
        measured_scales(ab, "kairos+")
