"""Unit tests of the continuous-batching engine model (kairos/core/engine_model): aborts in every
phase, requests that change during a step, usage errors, stale commits and bad noise."""

from __future__ import annotations

import pytest

from kairos.core.engine_model import EngineError
from tests.unit.engine_builders import add_running_decodes, make_engine, step


# -- aborts, errors, staleness ----------------------------------------------------------------
@pytest.mark.parametrize("phase", ["waiting", "awaiting_kv", "ready", "decoding", "deflected_prefill",
                                   "prefilling", "held"])
def test_abort_in_any_phase_frees_blocks(phase: str) -> None:
    role = "prefill" if phase in ("prefilling", "held") else "decode"
    e = make_engine(role, kv=4096, seqs=1, budget=128)
    if phase == "ready":  # KV arrived, but the only running slot is taken
        e.add_remote_decode("d0", 10, 5)
        e.add_remote_decode("r", 10, 5)
        e.admit()
        e.kv_arrived("d0")
        e.kv_arrived("r")
    elif role == "prefill":
        e.add_prefill("r", 100)
        if phase == "held":
            step(e)
    elif phase == "deflected_prefill":
        e.add_deflected("r", 100, 5, [64])
    else:
        e.add_remote_decode("big", 3500, 10)
        e.add_remote_decode("r", 1000, 10)  # waits behind big
        e.admit()
        if phase != "waiting":
            assert e.abort("big")
            e.admit()
            if phase == "decoding":
                e.kv_arrived("r")
    if phase in ("prefilling", "deflected_prefill"):
        e.admit()
    assert e.phase("r") == phase
    before = e.state().free_kv_tokens
    assert e.abort("r") is True and e.abort("r") is False
    assert e.phase("r") is None
    e.check_invariants()
    if phase != "waiting":
        assert e.state().free_kv_tokens > before
    assert "r" not in e.poll_allocated()


def test_abort_during_step_is_skipped_at_commit() -> None:
    e = make_engine()
    add_running_decodes(e, 2)
    e.add_deflected("x", 50, 3, [512])
    plan = e.plan_step()
    e.abort("d0")
    e.abort("x")
    e.add_deflected("x", 50, 3, [512])  # same id re-added: not in the plan
    res = e.commit_step(plan)
    assert res.tokens == (("d1", 0),) and res.first_tokens == ("d1",)
    assert e.progress("x") == (0, 0)
    e.check_invariants()


def test_kv_arrival_during_step_joins_next_step() -> None:
    e = make_engine()
    add_running_decodes(e, 1)
    e.add_remote_decode("late", 100, 2)
    plan = e.plan_step()
    assert plan.allocated == ("late",)
    assert e.poll_allocated() == ["late"]
    e.kv_arrived("late")
    res = e.commit_step(plan)
    assert res.tokens == (("d0", 0),) and res.allocated == ("late",)
    assert e.plan_step().decode_ids == ("d0", "late")


@pytest.mark.parametrize("case", ["duplicate", "wrong_role", "too_big", "zero_prompt", "zero_output",
                                  "bad_chi", "arrive_early", "release_early", "unknown"])
def test_errors(case: str) -> None:
    e = make_engine(kv=1024)
    with pytest.raises(EngineError):
        if case == "duplicate":
            e.add_remote_decode("a", 10, 1)
            e.add_deflected("a", 10, 1, [64])
        elif case == "wrong_role":
            e.add_prefill("a", 10)
        elif case == "too_big":
            e.add_remote_decode("a", 1000, 25)  # 1025 tokens > 1024
        elif case == "zero_prompt":
            e.add_remote_decode("a", 0, 1)
        elif case == "zero_output":
            e.add_deflected("a", 10, 0, [64])
        elif case == "bad_chi":
            e.add_deflected("a", 10, 1, [64, 0])
        elif case == "arrive_early":
            e.add_remote_decode("a", 1000, 24)
            e.add_remote_decode("b", 10, 1)  # waits behind a: no blocks yet
            e.kv_arrived("b")
        elif case == "release_early":
            p = make_engine("prefill")
            p.add_prefill("a", 5000)
            p.admit()
            p.release("a")
        else:
            e.kv_arrived("nope")


def test_exactly_fitting_request_is_accepted() -> None:
    e = make_engine(kv=1024)
    e.add_remote_decode("a", 1000, 24)
    assert e.admit() == ["a"] and e.state().free_kv_tokens == 0


def test_stale_or_repeated_commit_raises() -> None:
    e = make_engine()
    add_running_decodes(e, 1)
    old = e.plan_step()
    new = e.plan_step()
    assert old == new  # same state, same plan ...
    with pytest.raises(EngineError):
        e.commit_step(old)  # ... but only the latest object may be committed
    e.commit_step(new)
    with pytest.raises(EngineError):
        e.commit_step(new)
    other = make_engine()
    add_running_decodes(other, 1)
    with pytest.raises(EngineError):
        e.commit_step(other.plan_step())


def test_noise_sets_duration_and_bad_noise_raises() -> None:
    e = make_engine(noise=lambda ms: ms * 1.5)
    add_running_decodes(e, 3)
    plan = e.plan_step()
    assert plan.duration_ms == pytest.approx(1.5 * plan.predicted_ms)
    bad = make_engine(noise=lambda ms: -1.0)
    add_running_decodes(bad, 1)
    with pytest.raises(EngineError):
        bad.plan_step()
