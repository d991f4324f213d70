"""Unit tests of the continuous-batching engine model (kairos/core/engine_model): prefill nodes,
decode nodes on the keep path (admission, KV arrival, token semantics, running slots) and the
state an engine reports."""

from __future__ import annotations

import pytest

from kairos.core.cluster.snapshot import InFlightDeflection
from kairos.core.engine_model import EngineState
from tests.unit.engine_builders import MODEL, add_running_decodes, make_engine, run_until_empty, step


# -- prefill nodes ----------------------------------------------------------------------------
def test_prefill_node_fifo_equal_sizes_complete_in_arrival_order() -> None:
    e = make_engine("prefill", budget=512)
    for i in range(6):
        e.add_prefill(f"r{i}", 700)
    done = [rid for _, res in run_until_empty(e) for rid in res.prefill_done]
    assert done == [f"r{i}" for i in range(6)]


def test_prefill_node_small_late_request_does_not_overtake() -> None:
    e = make_engine("prefill", budget=2048)
    e.add_prefill("big1", 5000)
    e.add_prefill("big2", 5000)
    e.add_prefill("small", 10)
    trace = run_until_empty(e)
    done = [rid for _, res in trace for rid in res.prefill_done]
    assert done == ["big1", "big2", "small"]
    # chunks share steps: big1's remainder and big2's first chunk run together
    assert trace[2][0].prefill_chunks == (("big1", 904, 4096), ("big2", 1144, 0))
    for plan, _ in trace:
        assert plan.batch_size == 0 and plan.num_tokens <= 2048
        assert plan.predicted_ms == MODEL.step_ms(0, 0, plan.prefill_tokens, plan.prefill_cached)


def test_prefill_cached_is_token_weighted() -> None:
    e = make_engine("prefill", budget=1000)
    e.add_prefill("a", 1500)
    e.add_prefill("b", 2000)
    step(e)
    plan = e.plan_step()
    assert plan.prefill_chunks == (("a", 500, 1000), ("b", 500, 0))
    assert plan.prefill_cached == pytest.approx((500 * 1000 + 500 * 0) / 1000)


def test_prefill_node_emits_no_tokens_and_holds_blocks_until_release() -> None:
    e = make_engine("prefill", budget=512, kv=4096)
    e.add_prefill("a", 1000)
    results = [step(e)[1] for _ in range(2)]
    assert all(r.tokens == () and r.first_tokens == () for r in results)
    assert results[0].prefill_done == () and results[1].prefill_done == ("a",)
    assert e.phase("a") == "held" and e.plan_step() is None and e.idle
    st0 = e.state()
    assert (st0.held, st0.used_kv_tokens, st0.free_kv_tokens) == (1, 1008, 4096 - 1008)
    e.release("a")
    assert e.state().free_kv_tokens == 4096 and e.num_requests == 0


def test_prefill_node_blocked_admission_resumes_after_release() -> None:
    e = make_engine("prefill", budget=2048, kv=2048, block=16)
    e.add_prefill("a", 1500)  # 94 blocks of 128
    e.add_prefill("b", 600)  # 38 blocks: does not fit next to a
    _, res = step(e)
    assert res.prefill_done == ("a",)
    assert e.phase("b") == "waiting" and e.plan_step() is None
    assert e.state().queue_prompt_tokens == [600]
    e.release("a")
    plan, res = step(e)
    assert plan.prefill_chunks == (("b", 600, 0),) and res.prefill_done == ("b",)


# -- decode nodes: keep path ------------------------------------------------------------------
def test_remote_decode_token_semantics() -> None:
    e = make_engine()
    e.add_remote_decode("r", 500, 3)
    assert e.plan_step() is None  # admitted, but its KV has not arrived
    assert e.poll_allocated() == ["r"] and e.poll_allocated() == []
    assert e.phase("r") == "awaiting_kv" and e.idle
    e.kv_arrived("r")
    out = [step(e) for _ in range(3)]
    assert [res.tokens for _, res in out] == [(("r", 0),), (("r", 1),), (("r", 2),)]
    assert [res.first_tokens for _, res in out] == [("r",), (), ()]
    assert [res.finished for _, res in out] == [(), (), ("r",)]
    assert [plan.kv_tokens for plan, _ in out] == [500, 501, 502]  # context = prompt + emitted
    assert e.plan_step() is None and e.num_requests == 0 and e.state().free_kv_tokens == 1_200_000


def test_single_output_token_finishes_on_first_token() -> None:
    e = make_engine()
    e.add_remote_decode("r", 10, 1)
    e.add_deflected("x", 10, 1, [128])
    e.admit()
    e.kv_arrived("r")
    _, res = step(e)
    assert res.tokens == (("r", 0), ("x", 0)) and res.first_tokens == ("r", "x")
    assert res.finished == ("r", "x") and e.num_requests == 0


def test_deflected_token_semantics() -> None:
    e = make_engine()
    e.add_deflected("x", 300, 3, [128])  # B = 0: 128 + 128 + 44
    out = [step(e) for _ in range(5)]
    assert [res.tokens for _, res in out[:3]] == [(), (), (("x", 0),)]
    assert out[2][1].first_tokens == ("x",)
    assert [res.tokens for _, res in out[3:]] == [(("x", 1),), (("x", 2),)]
    assert out[4][1].finished == ("x",)
    assert [p.deflected_chunk[3] for p, _ in out[:3]] == [128, 128, 44]
    assert [p.batch_size for p, _ in out] == [0, 0, 0, 1, 1]
    assert [p.kv_tokens for p, _ in out[3:]] == [301, 302]
    assert e.plan_step() is None


def test_decode_blocked_admission_head_of_line_and_resume() -> None:
    e = make_engine(kv=1600, block=16)  # 100 blocks
    e.add_remote_decode("a", 1000, 2)  # 63 blocks
    e.add_remote_decode("b", 1000, 2)  # does not fit
    e.add_remote_decode("c", 10, 2)  # fits, but FCFS: waits behind b
    assert e.admit() == ["a"]
    assert e.poll_allocated() == ["a"]
    st0 = e.state()
    assert (st0.waiting, st0.awaiting_kv, st0.free_kv_tokens) == (3, 1, 1600 - 63 * 16)
    e.kv_arrived("a")
    step(e)
    _, res = step(e)
    assert res.finished == ("a",)
    assert e.poll_allocated() == []  # freeing alone does not admit
    assert e.admit() == ["b", "c"] and e.poll_allocated() == ["b", "c"]


def test_unpolled_allocations_do_not_accumulate() -> None:
    """A driver that uses admit()'s return value never polls; the log must not grow."""
    e = make_engine()
    for i in range(50):
        e.add_remote_decode(f"r{i}", 100, 2)
    assert len(e.admit()) == 50
    for i in range(50):
        e.kv_arrived(f"r{i}")
    assert e.poll_allocated() == []


def test_max_num_seqs_caps_running_requests() -> None:
    e = make_engine(seqs=2, budget=64)
    for i in range(3):
        e.add_remote_decode(f"r{i}", 10, 2)
    # all three get blocks (awaiting KV holds no running slot) ...
    assert e.admit() == ["r0", "r1", "r2"]
    for i in range(3):
        e.kv_arrived(f"r{i}")
    # ... but only two run; r2 waits for a slot
    assert e.phase("r2") == "ready" and e.state().running == 2 and e.state().waiting == 1
    p1, _ = step(e)
    p2, r2 = step(e)
    assert p1.decode_ids == p2.decode_ids == ("r0", "r1") and r2.finished == ("r0", "r1")
    p3, _ = step(e)
    assert p3.decode_ids == ("r2",)


def test_running_slots_full_block_allocation() -> None:
    e = make_engine(seqs=1, budget=16)
    e.add_deflected("x", 100, 2, [16])
    e.add_remote_decode("r", 10, 2)
    e.admit()
    assert e.phase("r") == "waiting"  # vLLM stops the waiting loop at max_num_running_reqs
    run_until_empty(e)


# -- state ------------------------------------------------------------------------------------
def test_state_hand_built_decode_node() -> None:
    e = make_engine(kv=16 * 1000, block=16)  # 1000 blocks
    add_running_decodes(e, 2, prompt=100, output=10)  # 2 × ceil(110/16)=7 blocks
    e.add_remote_decode("k", 50, 5)  # 4 blocks, KV not arrived
    e.add_deflected("x", 1000, 20, [512])  # 64 blocks
    e.add_deflected("y", 300, 7, [512])  # 20 blocks
    e.add_remote_decode("huge", 15000, 1)  # 938 blocks: waits
    e.add_deflected("z", 40, 3, [512])  # behind huge
    step(e)  # d0, d1 emit token 0; x computes 510
    st0 = e.state()
    assert isinstance(st0, EngineState)
    assert st0.batch_size == 2
    assert st0.kv_tokens == 2 * 101
    assert st0.queue_prompt_tokens == [490, 300, 40]
    assert st0.deflection_in_flight is True
    assert st0.in_flight == [InFlightDeflection(490, 20), InFlightDeflection(300, 7), InFlightDeflection(40, 3)]
    assert st0.waiting == 3  # k (KV), huge and z (blocks)
    assert st0.awaiting_kv == 1
    assert st0.running == 4  # d0, d1, x, y
    assert st0.used_kv_tokens == (7 + 7 + 4 + 64 + 20) * 16
    assert st0.free_kv_tokens == 16 * 1000 - st0.used_kv_tokens
    assert st0.held == 0 and st0.steps == 1 and st0.role == "decode"


def test_state_prefill_node_queue() -> None:
    e = make_engine("prefill", budget=1000)
    for rid, n in (("a", 1500), ("b", 400), ("c", 700)):
        e.add_prefill(rid, n)
    assert e.state().queue_prompt_tokens == [1500, 400, 700]
    step(e)
    st0 = e.state()
    assert st0.queue_prompt_tokens == [500, 400, 700]
    assert (st0.batch_size, st0.kv_tokens, st0.deflection_in_flight, st0.in_flight) == (0, 0, False, [])
