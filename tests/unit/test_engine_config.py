"""Unit tests of the continuous-batching engine model (kairos/core/engine_model): its configuration
and the pure batching helpers (blocks, chunk sizes, the TBT guard's chunk)."""

from __future__ import annotations

import pytest

from kairos.core.engine_model import EngineConfig, EngineError
from kairos.core.engine_model.batching import blocks_needed, chunk_size_at, deflected_chunk_tokens, guard_chunk_tokens
from kairos.core.model.latency import EngineLimits
from tests.unit.engine_builders import MODEL


# -- config -----------------------------------------------------------------------------------
def test_config_from_limits_uses_role_budget() -> None:
    lim = EngineLimits(max_num_seqs=64, max_num_batched_tokens=4096, decode_max_num_batched_tokens=512,
                       kv_capacity_tokens=10_000, block_size=32)
    p = EngineConfig.from_limits("prefill", lim)
    d = EngineConfig.from_limits("decode", lim)
    assert (p.role, p.max_num_batched_tokens, d.role, d.max_num_batched_tokens) == ("prefill", 4096, "decode", 512)
    assert (d.max_num_seqs, d.kv_capacity_tokens, d.block_size, d.total_blocks) == (64, 10_000, 32, 312)


@pytest.mark.parametrize("kwargs", [
    dict(role="mixed"), dict(max_num_seqs=0), dict(block_size=0), dict(max_num_batched_tokens=8),
    dict(kv_capacity_tokens=8),
], ids=["role", "seqs", "block", "budget<seqs", "kv<block"])
def test_config_rejects_bad_values(kwargs: dict) -> None:
    base = dict(role="decode", max_num_seqs=16, max_num_batched_tokens=64, kv_capacity_tokens=1024, block_size=16)
    with pytest.raises(EngineError):
        EngineConfig(**{**base, **kwargs})


# -- pure helpers -----------------------------------------------------------------------------
@pytest.mark.parametrize("args, want", [
    ((1, 16), 1), ((16, 16), 1), ((17, 16), 2), ((1025, 16), 65),
], ids=["one", "exact", "spill", "big"])
def test_blocks_needed(args: tuple[int, int], want: int) -> None:
    assert blocks_needed(*args) == want


@pytest.mark.parametrize("schedule, i, want", [
    ([512, 256], 0, 512), ([512, 256], 1, 256), ([512, 256], 5, 256), ([], 3, 2048),
], ids=["first", "second", "past-end-reuses-last", "empty-uses-budget"])
def test_chunk_size_at(schedule: list[int], i: int, want: int) -> None:
    assert chunk_size_at(schedule, i, 2048) == want


@pytest.mark.parametrize("remaining, chi, B, left, want", [
    (1500, 512, 16, 2032, 496),  # χ − B
    (100, 512, 16, 2032, 100),  # the prompt's remainder
    (5000, 4096, 16, 2032, 2032),  # the token budget
    (5000, 16, 16, 2032, 1),  # χ ≤ B: still one token
], ids=["chi-minus-B", "remainder", "budget", "at-least-one"])
def test_deflected_chunk_tokens(remaining: int, chi: int, B: int, left: int, want: int) -> None:
    assert deflected_chunk_tokens(remaining, chi, B, left) == want


def test_guard_chunk_tokens_is_largest_safe() -> None:
    B, K, c = 32, 32 * 3000, 1000
    for limit in (60.0, 70.0, 100.0, 200.0):
        n = guard_chunk_tokens(MODEL, B, K, 2000, c, limit)
        full_ok = MODEL.step_ms(B, K, 2000, c) <= limit
        assert n == 2000 if full_ok else (MODEL.step_ms(B, K, n, c) <= limit < MODEL.step_ms(B, K, n + 1, c))
    assert guard_chunk_tokens(MODEL, B, K, 2000, c, 50.0) == 1  # even one token is over: still 1
