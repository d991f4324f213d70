"""Builders shared by the engine model's unit tests (tests/unit/test_engine_config, _chunks, _nodes,
_errors and _fuzz): an engine on the default latency profile
(:func:`kairos.core.model.latency.load_profile`), running decodes, one step, and a drain loop."""

from __future__ import annotations

from kairos.core.engine_model import Engine, EngineConfig, StepPlan, StepResult
from kairos.core.model.latency import LatencyModel, load_profile

MODEL: LatencyModel = load_profile()


def make_engine(role: str = "decode", *, seqs: int = 256, budget: int = 2048, kv: int = 1_200_000,
                block: int = 16, noise=None, guard: float | None = None) -> Engine:
    cfg = EngineConfig(role=role, max_num_seqs=seqs, max_num_batched_tokens=budget,
                       kv_capacity_tokens=kv, block_size=block)
    return Engine(cfg, MODEL, noise, tbt_guard_ms=guard)


def add_running_decodes(e: Engine, n: int, prompt: int = 1000, output: int = 1000, prefix: str = "d") -> None:
    """n remote decodes whose KV has arrived (running decodes, no token emitted yet)."""
    for i in range(n):
        e.add_remote_decode(f"{prefix}{i}", prompt, output)
    e.admit()
    for rid in e.poll_allocated():
        e.kv_arrived(rid)


def step(e: Engine) -> tuple[StepPlan, StepResult]:
    plan = e.plan_step()
    assert plan is not None
    return plan, e.commit_step(plan)


def run_until_empty(e: Engine, max_steps: int = 100_000) -> list[tuple[StepPlan, StepResult]]:
    """Step, arrive every allocated KV and release every done prefill until the engine is empty."""
    out = []
    for _ in range(max_steps):
        for rid in e.poll_allocated():
            e.kv_arrived(rid)
        plan = e.plan_step()
        for rid in e.poll_allocated():
            e.kv_arrived(rid)
        if plan is None:
            if e.num_requests == 0:
                return out
            continue
        res = e.commit_step(plan)
        for rid in res.prefill_done:
            e.release(rid)
        out.append((plan, res))
    raise AssertionError("engine did not drain")
