"""Unit tests of the continuous-batching engine model (kairos/core/engine_model) on many steps:
determinism, random workloads (Hypothesis and longer seeded runs) checked against the invariants
and the token counts, and a performance smoke test."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kairos.core.engine_model import EngineError, StepPlan
from tests.unit.engine_builders import make_engine


# -- determinism ------------------------------------------------------------------------------
def _scripted_run(seed: int) -> list[StepPlan]:
    rng = random.Random(seed)
    noise_rng = random.Random(seed + 1)
    e = make_engine(noise=lambda ms: ms * noise_rng.uniform(0.9, 1.1), kv=200_000, guard=80.0)
    plans = []
    for i in range(300):
        if rng.random() < 0.3:
            e.add_remote_decode(f"r{i}", rng.randint(1, 4000), rng.randint(1, 60))
        if rng.random() < 0.1:
            e.add_deflected(f"x{i}", rng.randint(1, 4000), rng.randint(1, 60), [1024, 512, 256])
        for rid in e.poll_allocated():
            e.kv_arrived(rid)
        plan = e.plan_step()
        if plan is not None:
            plans.append(plan)
            e.commit_step(plan)
    return plans


def test_determinism_same_inputs_same_plans() -> None:
    a, b = _scripted_run(7), _scripted_run(7)
    assert len(a) > 200 and a == b
    assert _scripted_run(8) != a


# -- random workloads (hypothesis) ------------------------------------------------------------
OPS = st.lists(
    st.tuples(st.sampled_from(["add"] * 3 + ["step"] * 4 + ["arrive"] * 2 + ["release", "abort"]),
              st.one_of(st.integers(1, 40), st.integers(1, 300)), st.integers(1, 12), st.integers(0, 10**6)),
    min_size=10, max_size=120)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(role=st.sampled_from(["prefill", "decode"]), seqs=st.integers(1, 6), extra_budget=st.integers(0, 200),
       blocks=st.integers(8, 80), block=st.sampled_from([1, 4, 16]), ops=OPS,
       guard=st.sampled_from([None, 50.0]), noisy=st.booleans())
def test_random_workloads_respect_budget_capacity_and_counts(role, seqs, extra_budget, blocks, block, ops,
                                                            guard, noisy) -> None:
    fuzz(role, seqs, seqs + extra_budget, blocks, block, ops, guard, noisy)


@pytest.mark.parametrize("seed", range(12))
def test_long_random_workloads(seed: int) -> None:
    """Longer seeded runs than hypothesis explores: busier nodes, more interleaving."""
    rng = random.Random(seed)
    kinds = ["add"] * 3 + ["step"] * 5 + ["arrive"] * 2 + ["release", "abort"]
    ops = [(rng.choice(kinds), rng.randint(1, 600), rng.randint(1, 30), rng.randint(0, 10**6)) for _ in range(600)]
    seqs = rng.randint(1, 32)
    fuzz(rng.choice(["prefill", "decode"]), seqs, seqs + rng.randint(0, 512), rng.randint(40, 400),
         rng.choice([1, 16]), ops, rng.choice([None, 60.0]), rng.random() < 0.5)


def fuzz(role: str, seqs: int, budget: int, blocks: int, block: int, ops: list[tuple[str, int, int, int]],
         guard: float | None, noisy: bool) -> None:
    """Apply ``ops`` (kind, size a, size b, pick), checking the invariants after each, then drain and
    check that every request that was not aborted got exactly its tokens, in order."""
    rng = random.Random(len(ops))
    noise = (lambda ms: ms * rng.uniform(0.8, 1.2)) if noisy else None
    e = make_engine(role, seqs=seqs, budget=budget, kv=blocks * block, block=block, noise=noise, guard=guard)
    cap = blocks * block
    want: dict[str, int] = {}  # id -> output tokens (decode node) or 1 (prefill node: one prefill_done)
    got: dict[str, list[int]] = {}
    aborted: set[str] = set()
    allocated: list[str] = []
    held: list[str] = []
    n = 0

    def do_step() -> None:
        idle = e.idle
        plan = e.plan_step()
        assert idle == (plan is None)
        allocated.extend(e.poll_allocated())
        if plan is None:
            return
        assert plan.num_tokens <= budget
        assert plan.batch_size == len(plan.decode_ids) == len(set(plan.decode_ids)) <= seqs
        assert plan.prefill_tokens == sum(c[1] for c in plan.prefill_chunks)
        assert all(c[1] >= 1 for c in plan.prefill_chunks)
        assert plan.duration_ms >= 0 and plan.predicted_ms > 0
        if role == "decode":
            assert len(plan.prefill_chunks) <= 1
        e.state()  # a heartbeat while the step runs (the simulator's): the commit must not leave it stale
        res = e.commit_step(plan)
        for rid, idx in res.tokens:
            assert got.setdefault(rid, []) == list(range(idx))  # token indexes in order, no gaps
            got[rid].append(idx)
        for rid in res.finished:
            assert len(got[rid]) == want[rid]
        for rid in res.prefill_done:
            got.setdefault(rid, []).append(0)
            held.append(rid)

    for op, a, b, pick in ops:
        if op == "add":
            rid = f"q{n}"
            n += 1
            need = a if role == "prefill" else a + b
            kind = pick % 2
            try:
                if role == "prefill":
                    e.add_prefill(rid, a)
                    want[rid] = 1
                elif kind == 0:
                    e.add_remote_decode(rid, a, b)
                    want[rid] = b
                else:
                    e.add_deflected(rid, a, b, [1 + pick % 300, 1 + pick % 97])
                    want[rid] = b
            except EngineError:
                assert -(-need // block) > blocks
            else:
                assert -(-need // block) <= blocks
        elif op == "step":
            do_step()
        elif op == "arrive":
            allocated.extend(e.poll_allocated())
            live = [r for r in allocated if e.phase(r) == "awaiting_kv"]
            if live:
                e.kv_arrived(live[pick % len(live)])
        elif op == "release":
            live = [r for r in held if e.phase(r) == "held"]
            if live:
                e.release(live[pick % len(live)])
        elif op == "abort" and want:
            rid = sorted(want)[pick % len(want)]
            if e.abort(rid):
                aborted.add(rid)
        e.check_invariants()
        st0 = e.state()
        assert 0 <= st0.free_kv_tokens <= cap and st0.used_kv_tokens + st0.free_kv_tokens == blocks * block
        assert st0.running <= seqs

    # drain: every live request completes with exactly its token count
    for _ in range(20_000):
        allocated.extend(e.poll_allocated())
        for r in allocated:
            if e.phase(r) == "awaiting_kv":
                e.kv_arrived(r)
        for r in held:
            if e.phase(r) == "held":
                e.release(r)
        if e.num_requests == 0:
            break
        do_step()
        e.check_invariants()
    assert e.num_requests == 0 and e.state().free_kv_tokens == cap
    for rid, k in want.items():
        if rid not in aborted:
            assert len(got.get(rid, [])) == k, rid


# -- performance smoke ------------------------------------------------------------------------
def test_many_steps_are_cheap() -> None:
    """A 20k-step run with ~40 running decodes stays well under the test budget."""
    e = make_engine()
    rng = random.Random(3)
    i = 0
    for _ in range(20_000):
        if rng.random() < 0.05:
            e.add_remote_decode(f"r{i}", rng.randint(100, 3000), rng.randint(200, 1000))
            i += 1
        for rid in e.poll_allocated():
            e.kv_arrived(rid)
        plan = e.plan_step()
        if plan is not None:
            e.commit_step(plan)
    assert e.steps > 19_000
