"""Workload loaders, windows and generators (kairos/core/workload/workloads.py; paper §3, Table 1)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kairos.core.workload.workloads import (
    BUNDLED_TRACES, KINDS, TRACES_DIR, WorkloadError, WorkloadRequest, busiest_window, generate,
    load_azure_csv, load_mooncake_jsonl, load_plain_csv, load_trace, parse_workload,
    rescale_to_rps, window,
)


def _arrivals(reqs: list[WorkloadRequest]) -> np.ndarray:
    return np.array([r.arrival_s for r in reqs])


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def mooncake() -> list[WorkloadRequest]:
    return load_mooncake_jsonl(TRACES_DIR / BUNDLED_TRACES["mooncake"], seed=0)


# ---------------------------------------------------------------- bundled traces

@pytest.mark.parametrize("name, rows", [("azure-code", 8819), ("azure-conv", 19366), ("mooncake", 12031)])
def test_bundled_trace_row_counts_and_invariants(name: str, rows: int) -> None:
    reqs = parse_workload(name, None, None, seed=0)
    t = _arrivals(reqs)
    assert len(reqs) == rows
    assert t[0] == pytest.approx(0.0, abs=3.0)  # Mooncake: first bucket spread over [0, 3) s
    assert np.all(np.diff(t) >= 0)
    assert 3400 < t[-1] < 3600  # ~1 h traces (data README)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in reqs)
    assert max(r.prompt_tokens + r.output_tokens for r in reqs) <= 32768
    assert len({r.id for r in reqs}) == rows
    assert reqs[0].id.startswith(f"{name}-")


def test_azure_code_arrivals_are_seconds_since_first_row() -> None:
    reqs = load_azure_csv(TRACES_DIR / BUNDLED_TRACES["azure-code"])
    # rows 1-2: 18:17:03.9799600 (4808, 10) and 18:17:04.0319600 (3180, 8)
    assert (reqs[0].arrival_s, reqs[0].prompt_tokens, reqs[0].output_tokens) == (0.0, 4808, 10)
    assert reqs[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert (reqs[1].prompt_tokens, reqs[1].output_tokens) == (3180, 8)
    assert reqs[0].id == "AzureLLMInferenceTrace_code_2023-000000"


def test_mooncake_spread_stays_in_bucket_and_is_seeded(mooncake: list[WorkloadRequest]) -> None:
    lines = (TRACES_DIR / BUNDLED_TRACES["mooncake"]).read_text().splitlines()
    raw_ms = np.array([json.loads(line)["timestamp"] for line in lines], dtype=float)
    for r in mooncake:
        row = int(r.id.rsplit("-", 1)[1])
        offset_ms = r.arrival_s * 1000.0 - raw_ms[row]
        assert -1e-6 <= offset_ms < 3000.0, r
    t = _arrivals(mooncake)
    assert len(np.unique(t)) == len(t)  # spread: no simultaneous bursts left
    assert np.all(np.diff(t) >= 0)
    again = load_mooncake_jsonl(TRACES_DIR / BUNDLED_TRACES["mooncake"], seed=0)
    other = load_mooncake_jsonl(TRACES_DIR / BUNDLED_TRACES["mooncake"], seed=1)
    assert again == mooncake
    assert _arrivals(other).tolist() != t.tolist()


def test_mooncake_long_prompts_are_capped_keeping_output(mooncake: list[WorkloadRequest]) -> None:
    lines = (TRACES_DIR / BUNDLED_TRACES["mooncake"]).read_text().splitlines()
    raw = [json.loads(line) for line in lines]
    by_id = {r.id: r for r in mooncake}
    capped = [(row, by_id[f"mooncake_conversation_trace-{i:06d}"]) for i, row in enumerate(raw)
              if row["input_length"] > 32768]
    assert len(capped) == 828
    for row, req in capped:
        assert req.output_tokens == max(row["output_length"], 1)
        assert req.prompt_tokens == 32768 - req.output_tokens


# ---------------------------------------------------------------- loaders on small files

def test_azure_timestamp_parsing_with_100ns_digits(tmp_path: Path) -> None:
    path = _write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                  "2023-11-16 18:15:46.6805900,374,44\n"
                  "2023-11-16 18:15:48.0000001,10,0\n"
                  "2023-11-16T18:16:46,20,3\n")
    reqs = load_azure_csv(path, id_prefix="az")
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 1.31941, 59.31941], abs=1e-6)
    assert reqs[1].output_tokens == 1  # zero output clamped to 1
    assert [r.id for r in reqs] == ["az-000000", "az-000001", "az-000002"]


@pytest.mark.parametrize("line, field", [
    ("2023-11-16 18:15:47.0,abc,4", "ContextTokens"),
    ("2023-11-16 18:15:47.0,12,-1", "GeneratedTokens"),
    ("not-a-time,12,4", "TIMESTAMP"),
    ("2023-11-16 18:15:47.0,0,4", "ContextTokens"),
], ids=["non-int", "negative", "bad-time", "zero-prompt"])
def test_malformed_azure_line_names_file_line_and_field(tmp_path: Path, line: str, field: str) -> None:
    path = _write(tmp_path, "bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                  "2023-11-16 18:15:46.0,10,2\n" + line + "\n")
    with pytest.raises(WorkloadError, match=rf"bad\.csv:3: field {field}"):
        load_azure_csv(path)


def test_malformed_files_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"lacks column"):
        load_azure_csv(_write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n"))
    with pytest.raises(WorkloadError, match=r"s\.csv:2: expected 3 fields"):
        load_plain_csv(_write(tmp_path, "s.csv", "arrival_s,prompt_tokens,output_tokens\n1.0,5\n"))
    with pytest.raises(WorkloadError, match=r"n\.csv:3: field arrival_s"):
        load_plain_csv(_write(tmp_path, "n.csv", "arrival_s,prompt_tokens,output_tokens\n0,1,1\nnan,5,5\n"))
    with pytest.raises(WorkloadError, match=r"no requests"):
        load_plain_csv(_write(tmp_path, "e.csv", "arrival_s,prompt_tokens,output_tokens\n"))
    with pytest.raises(WorkloadError, match=r"cannot read"):
        load_plain_csv(tmp_path / "missing.csv")
    bad_json = ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
                '{"timestamp": 3000, "input_length": "x", "output_length": 1}\n')
    with pytest.raises(WorkloadError, match=r"m\.jsonl:2: .*\$\.input_length"):
        load_mooncake_jsonl(_write(tmp_path, "m.jsonl", bad_json))


def test_plain_csv_sorts_caps_and_clamps(tmp_path: Path) -> None:
    path = _write(tmp_path, "p.csv", "arrival_s,prompt_tokens,output_tokens,note\n"
                  "2.5,40000,100,x\n0.5,10,0,y\n")
    reqs = load_plain_csv(path, id_prefix="p")
    assert reqs == [WorkloadRequest("p-000001", 0.5, 10, 1), WorkloadRequest("p-000000", 2.5, 32668, 100)]
    small = load_plain_csv(path, max_model_len=1000)
    assert (small[1].prompt_tokens, small[1].output_tokens) == (900, 100)


def test_load_trace_detects_format(tmp_path: Path) -> None:
    plain = _write(tmp_path, "w.csv", "arrival_s,prompt_tokens,output_tokens\n0,5,5\n")
    assert load_trace(plain) == [WorkloadRequest("w-000000", 0.0, 5, 5)]
    assert parse_workload(f"trace:{plain}", None, None, 0)[0].id == "trace-000000"
    with pytest.raises(WorkloadError, match="unknown trace format"):
        load_trace(_write(tmp_path, "x.csv", "a,b\n1,2\n"))


def test_unknown_spec_lists_valid_ones() -> None:
    with pytest.raises(WorkloadError, match=r"valid: .*lpld.*azure-code.*mooncake.*trace:PATH"):
        parse_workload("poisson", 1.0, 10.0, 0)
    with pytest.raises(WorkloadError, match="duration_s"):
        parse_workload("bursty", None, None, 0)


# ---------------------------------------------------------------- windows and rescaling

def _reqs(times: list[float]) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"r-{i:06d}", t, 10, 2) for i, t in enumerate(times)]


def test_window_is_half_open_and_rebased() -> None:
    out = window(_reqs([0.0, 1.0, 2.0, 3.0, 4.0]), 1.0, 2.0)
    assert [(r.id, r.arrival_s) for r in out] == [("r-000001", 0.0), ("r-000002", 1.0)]


def test_busiest_window_finds_densest_stretch() -> None:
    start, out = busiest_window(_reqs([0.0, 10.0, 10.5, 11.0, 11.9, 30.0, 30.1]), 2.0)
    assert start == 10.0
    assert [r.arrival_s for r in out] == pytest.approx([0.0, 0.5, 1.0, 1.9])
    assert busiest_window([], 60.0) == (0.0, [])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=40).map(sorted),
       st.floats(0.1, 30))
def test_busiest_window_beats_every_window_starting_at_an_arrival(times: list[float], duration: float) -> None:
    reqs = _reqs(times)
    _, best = busiest_window(reqs, duration)
    assert all(len(best) >= len(window(reqs, t, duration)) for t in times)
    assert all(0 <= r.arrival_s < duration for r in best)


def test_trace_rescaled_to_rps_then_windowed() -> None:
    full = parse_workload("azure-conv", 10.0, None, 0)
    t = _arrivals(full)
    assert (len(t) - 1) / (t[-1] - t[0]) == pytest.approx(10.0)
    cut = parse_workload("azure-code", 4.0, 60.0, 0)
    assert cut and _arrivals(cut).max() < 60.0
    with pytest.raises(WorkloadError):
        rescale_to_rps(_reqs([1.0]), 2.0)


# ---------------------------------------------------------------- generators

@pytest.mark.parametrize("kind", KINDS)
def test_generator_is_reproducible_from_seed(kind: str) -> None:
    a = generate(kind, 5.0, 60.0, seed=7)
    assert a == generate(kind, 5.0, 60.0, seed=7)
    assert a != generate(kind, 5.0, 60.0, seed=8)
    assert [r.id for r in a[:2]] == [f"{kind}-000000", f"{kind}-000001"]
    assert np.all(np.diff(_arrivals(a)) >= 0) and _arrivals(a).max() < 60.0


def test_poisson_mean_rate_and_cv() -> None:
    reqs = generate("lpld", 20.0, 500.0, seed=3)  # ~10,000 arrivals, count s.d. ~1 %
    gaps = np.diff(_arrivals(reqs))
    assert len(reqs) / 500.0 == pytest.approx(20.0, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)


def test_bursty_interarrivals_are_overdispersed() -> None:
    reqs = generate("bursty", 4.0, 2500.0, seed=3)  # default Gamma shape 0.25 → CV 2
    gaps = np.diff(_arrivals(reqs))
    assert len(reqs) / 2500.0 == pytest.approx(4.0, rel=0.08)
    assert gaps.std() / gaps.mean() > 1.7
    poissonish = np.diff(_arrivals(generate("bursty", 4.0, 2500.0, seed=3, gamma_shape=1.0)))
    assert poissonish.std() / poissonish.mean() == pytest.approx(1.0, abs=0.1)


# (prompt lower, prompt upper, output lower, output upper), strict bounds from §3 percentiles
STRATA = {"lpld": (0, 2071, 0, 21), "lphd": (0, 2071, 163, None), "hpld": (10336, None, 0, 21),
          "hphd": (10336, None, 163, None), "bursty": (0, None, 0, None)}


@pytest.mark.parametrize("kind", KINDS)
def test_strata_respect_bounds_and_context_window(kind: str) -> None:
    reqs = generate(kind, 100.0, 50.0, seed=1)
    p = np.array([r.prompt_tokens for r in reqs])
    o = np.array([r.output_tokens for r in reqs])
    p_lo, p_hi, o_lo, o_hi = STRATA[kind]
    assert p.min() > p_lo and o.min() > o_lo
    assert p_hi is None or p.max() < p_hi
    assert o_hi is None or o.max() < o_hi
    assert (p + o).max() <= 32768


@pytest.mark.parametrize("kind, prompt_median, output_median", [
    ("bursty", 3569, 50), ("hpld", 14013, 14), ("hphd", 13968, 226), ("lpld", 1385, 14),
])
def test_generated_medians(kind: str, prompt_median: int, output_median: int) -> None:
    reqs = generate(kind, 100.0, 100.0, seed=2)  # medians documented in the module docstring
    assert np.median([r.prompt_tokens for r in reqs]) == pytest.approx(prompt_median, rel=0.04)
    assert np.median([r.output_tokens for r in reqs]) == pytest.approx(output_median, rel=0.1)


def test_prompt_cap_follows_max_model_len() -> None:
    reqs = generate("hphd", 50.0, 20.0, seed=0, max_model_len=12000)
    assert all(r.prompt_tokens > 10336 and r.prompt_tokens + r.output_tokens <= 12000 for r in reqs)
    assert any(r.prompt_tokens + r.output_tokens == 12000 for r in reqs)  # the cap binds
    with pytest.raises(WorkloadError, match="max_model_len"):
        generate("hphd", 1.0, 10.0, seed=0, max_model_len=10000)


@pytest.mark.parametrize("kwargs", [{"rps": 0.0}, {"duration_s": -1.0}, {"kind": "llm"}],
                         ids=["rps", "duration", "kind"])
def test_generator_rejects_bad_parameters(kwargs: dict) -> None:
    args = {"kind": "bursty", "rps": 1.0, "duration_s": 10.0, "seed": 0} | kwargs
    with pytest.raises(WorkloadError):
        generate(**args)


def test_parse_workload_uses_table1_rate_by_default() -> None:
    reqs = parse_workload("LPHD", None, 100.0, seed=0)
    assert len(reqs) / 100.0 == pytest.approx(20.0, rel=0.1)
    assert reqs == generate("lphd", 20.0, 100.0, seed=0)


def test_busiest_suffix_takes_the_busiest_window():
    from kairos.core.workload.workloads import busiest_window, load_trace, parse_workload, TRACES_DIR, BUNDLED_TRACES

    wl = parse_workload("azure-code:busiest", None, 60, seed=0)
    full = load_trace(TRACES_DIR / BUNDLED_TRACES["azure-code"], id_prefix="azure-code")
    start, best = busiest_window(full, 60)
    assert [r.id for r in wl] == [r.id for r in best]
    assert len(wl) > len(parse_workload("azure-code", None, 60, seed=0))
    assert all(0 <= r.arrival_s < 60 for r in wl)
    with pytest.raises(WorkloadError):
        parse_workload("bursty:busiest", 4, 60, seed=0)
