"""Unit tests of the continuous-batching engine model (kairos/core/engine_model): a deflected
prefill's chunk schedule (§5.4), one deflected prefill at a time, and the TBT guard."""

from __future__ import annotations

from tests.unit.engine_builders import MODEL, add_running_decodes, make_engine, step


# -- chunk schedules (§5.4) -----------------------------------------------------------------
def test_chunk_schedule_followed_step_by_step() -> None:
    e = make_engine()
    add_running_decodes(e, 16)
    e.add_deflected("x", 1500, 4, [512, 512, 256])
    chunks, chis, Bs, cached = [], [], [], []
    while e.phase("x") == "deflected_prefill" or e.phase("x") == "waiting":
        plan, _ = step(e)
        rid, i, chi, n = plan.deflected_chunk
        assert rid == "x" and i == len(chunks)
        assert plan.prefill_chunks == (("x", n, sum(chunks)),)
        # predicted latency is the model's, with the decodes' K and the chunk's own cached tokens
        assert plan.predicted_ms == MODEL.step_ms(plan.batch_size, plan.kv_tokens, n, sum(chunks))
        assert plan.duration_ms == plan.predicted_ms
        chunks.append(n)
        chis.append(chi)
        Bs.append(plan.batch_size)
    # χ counts the B = 16 decode tokens; past the schedule the last χ is reused
    assert chunks == [496, 496, 240, 240, 28]
    assert chis == [512, 512, 256, 256, 256]
    assert Bs == [16] * 5
    plan, _ = step(e)
    assert plan.batch_size == 17 and plan.deflected_chunk is None  # x now decodes here


def test_chunk_at_least_one_token_when_chi_not_above_B() -> None:
    e = make_engine()
    add_running_decodes(e, 20)
    e.add_deflected("x", 3, 2, [16])
    ns = [step(e)[0].deflected_chunk[3] for _ in range(3)]
    assert ns == [1, 1, 1]
    assert e.phase("x") == "decoding"


def test_empty_schedule_uses_token_budget() -> None:
    e = make_engine(budget=300)
    add_running_decodes(e, 4)
    e.add_deflected("x", 1000, 2, [])
    plan, _ = step(e)
    assert plan.deflected_chunk == ("x", 0, 300, 296)
    assert plan.num_tokens == 300


def test_deflected_chunk_capped_by_budget() -> None:
    e = make_engine(budget=256)
    add_running_decodes(e, 6)
    e.add_deflected("x", 5000, 2, [2048])
    plan, _ = step(e)
    assert plan.deflected_chunk[3] == 250 and plan.num_tokens == 256


def test_one_deflected_prefill_at_a_time_fifo() -> None:
    e = make_engine()
    add_running_decodes(e, 2)
    e.add_deflected("a", 600, 3, [256])
    e.add_deflected("b", 100, 3, [256])
    st0 = e.state()
    assert st0.queue_prompt_tokens == [600, 100] and st0.deflection_in_flight
    seen = []
    for _ in range(6):
        plan, _ = step(e)
        if plan.deflected_chunk:
            seen.append(plan.deflected_chunk[0])
        assert len(plan.prefill_chunks) <= 1
    assert seen == ["a", "a", "a", "b"]  # 254 + 254 + 92, then b (B = 3 now: 253 ≥ 100)


def test_guard_shrinks_chunk_when_batch_grew() -> None:
    guard = 70.0
    # the schedule was safe for the decision-time state (B=4, K=4·2000) ...
    chi = 512
    assert MODEL.step_ms(4, 8000, chi - 4, 0) <= guard
    for g in (None, guard):
        e = make_engine(guard=g)
        # ... but 60 more decodes with long contexts joined before the prefill ran
        add_running_decodes(e, 64, prompt=8000)
        e.add_deflected("x", 4000, 2, [chi])
        plan = e.plan_step()
        B, K, (_, _, _, n) = plan.batch_size, plan.kv_tokens, plan.deflected_chunk
        if g is None:
            assert n == chi - B
            assert plan.predicted_ms > guard
        else:
            assert 1 <= n < chi - B
            assert plan.predicted_ms <= guard
            assert MODEL.step_ms(B, K, n + 1, 0) > guard  # largest safe chunk


def test_guard_keeps_one_token_when_nothing_fits() -> None:
    e = make_engine(guard=1.0)  # below even the decode-only step
    add_running_decodes(e, 4)
    e.add_deflected("x", 50, 2, [512])
    plan = e.plan_step()
    assert plan.deflected_chunk[3] == 1


def test_guard_leaves_safe_chunk_alone() -> None:
    e = make_engine(guard=1e9)
    add_running_decodes(e, 4)
    e.add_deflected("x", 5000, 2, [512])
    assert e.plan_step().deflected_chunk[3] == 508
