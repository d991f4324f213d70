"""The pieces every policy shares (kairos/core/policy/common.py), by hand with the tiny model
(tests/factories.py): the cached-prefix cap, the prefill node of Eq. 1 and its kairos+ terms, the
keep path's KV receiver and the static policies' deflection target."""

from __future__ import annotations

import msgspec
import pytest

from kairos.core.policy import PolicyParams
from kairos.core.policy.common import (best_prefill, deflect_target, keep_receiver, least_loaded_decode, request_hit,
                                      tie_index)
from kairos.core.cluster.snapshot import ClusterSnapshot, DecodeNodeView, InFlightDeflection, PrefillNodeView, RequestView
from tests.factories import tiny_model

M = tiny_model()


def snap(prefill=None, decode=None, prompt=250):
    return ClusterSnapshot(request=RequestView(id="r", prompt_tokens=prompt),
                           prefill_nodes=prefill or [PrefillNodeView(id="p0")],
                           decode_nodes=decode or [DecodeNodeView(id="d0", batch_size=1, kv_tokens=1)])


@pytest.mark.parametrize("cached, hit", [(0, 0), (50, 50), (99, 99), (100, 99), (150, 99)])
def test_request_hit_leaves_at_least_one_prompt_token_to_compute(cached, hit):
    # ℓ = 100: a cache holding all of it (or more) still leaves the last token to compute
    assert request_hit(DecodeNodeView(id="d", batch_size=0, kv_tokens=0, cached_prefix_tokens=cached), 100) == hit


# ℓ = 250, χ_p = 100: T_pf(250) = 57 (test_policy_equations.py::test_eq3), from c = 50: 42;
# W([300, 100]) = 88. The KV of t tokens crosses the link in 1 + t·1000 B / 1 GB/s = 1 + t/1000 ms.
PREFILL = [PrefillNodeView(id="p0", queue_prompt_tokens=[300, 100]),
           PrefillNodeView(id="p1", kv_backlog_ms=100.0, step_bias=2.0),
           PrefillNodeView(id="p2", cached_prefix_tokens=50)]


@pytest.mark.parametrize("switches, include_kv, kv_tokens, want", [
    # Eq. 1 as printed: 145, 57, 57 → the tie goes to the node listed first; KV of ℓ: 1.25 ms
    ({}, False, None, ("p1", 57.0, 1.25)),
    # correction: p1's 57 · 2 = 114 → p2
    ({"model_correction": True}, False, None, ("p2", 57.0, 1.25)),
    # cache-aware: p2 computes the 200 tokens past its prefix → 42
    ({"prefix_aware": True}, False, None, ("p2", 42.0, 1.25)),
    # KV-aware with 100 tokens to send (1.1 ms): 146.1, 57 + 100 + 1.1, 58.1
    ({}, True, 100, ("p2", 58.1, 1.1)),
    # all three: 145 + 1.25; the bias scales Eq. 2–3 only (114 + 100 + 1.25); 42 + 1.25
    ({"model_correction": True, "prefix_aware": True}, True, None, ("p2", 43.25, 1.25)),
])
def test_best_prefill_eq1_and_its_kairos_plus_terms(switches, include_kv, kv_tokens, want):
    params = PolicyParams(prefill_chunk_tokens=100, **switches)
    node, ttft, kv_ms = best_prefill(snap(PREFILL), M, params, include_kv=include_kv, kv_tokens=kv_tokens)
    assert (node, ttft, kv_ms) == (want[0], pytest.approx(want[1]), pytest.approx(want[2]))


def test_best_prefill_counts_no_kv_unless_asked():
    # p1 alone, with a 100 ms backlog: the default (include_kv off) leaves TTFT_pf at Eq. 1's 57
    assert best_prefill(snap(PREFILL[1:2]), M, PolicyParams(prefill_chunk_tokens=100))[1] == pytest.approx(57.0)


DECODE = [DecodeNodeView(id="d0", batch_size=4, kv_tokens=900, cached_prefix_tokens=100),
          DecodeNodeView(id="d1", batch_size=9, kv_tokens=500),
          DecodeNodeView(id="d2", batch_size=3, kv_tokens=500, waiting=2),
          DecodeNodeView(id="d3", batch_size=3, kv_tokens=500, waiting=1),
          DecodeNodeView(id="d4", batch_size=3, kv_tokens=500, waiting=1, cached_prefix_tokens=100)]


def test_least_loaded_decode_orders_by_kv_then_batch_then_waiting_then_request_hash():
    # KV 500 beats 900; among the 500s batch 3 beats 9; waiting 1 beats 2; d3 and d4 tie exactly:
    # the request id's hash picks one ("r" → index 1 of 2)
    assert tie_index("r", 2) == 1
    assert least_loaded_decode(snap(decode=DECODE)) == "d4"
    assert least_loaded_decode(snap(decode=DECODE[:4])) == "d3"
    assert least_loaded_decode(snap(decode=DECODE[:3])) == "d2"
    assert least_loaded_decode(snap(decode=DECODE[:2])) == "d1"


def test_tie_index_without_a_tie_is_0_and_takes_no_hash():
    # one node (no tie) or an empty list: index 0 for every id; with no node there is nothing to take
    # a hash modulo (no ZeroDivisionError); a real tie: an index into it
    for rid in ("r", "req-7", "", "ünïcode"):
        assert tie_index(rid, 1) == 0
        assert tie_index(rid, 0) == 0
    assert sorted({tie_index(f"q{i}", 3) for i in range(64)}) == [0, 1, 2]


def test_tied_decode_nodes_are_spread_over_requests_and_the_choice_is_stable():
    # four equally loaded nodes (a burst between two views): the choice depends only on the request
    # id, so every replica (and the simulator) makes the same one, and different requests spread
    same = [DecodeNodeView(id=f"d{i}", batch_size=2, kv_tokens=100) for i in range(4)]
    picks = []
    for i in range(64):
        s = msgspec.structs.replace(snap(decode=same), request=RequestView(id=f"req-{i}", prompt_tokens=250))
        picks.append(least_loaded_decode(s))
        assert least_loaded_decode(s) == picks[-1] == f"d{tie_index(f'req-{i}', 4)}"
    assert min(picks.count(f"d{i}") for i in range(4)) >= 8
    # a less loaded node still wins outright, whatever the id
    light = [*same[:3], DecodeNodeView(id="d3", batch_size=1, kv_tokens=100)]
    assert all(least_loaded_decode(msgspec.structs.replace(snap(decode=light), request=RequestView(id=f"q{i}", prompt_tokens=250)))
               == "d3" for i in range(16))


def test_keep_receiver_prefers_the_longest_prefix_only_when_prefix_aware():
    s = snap(decode=DECODE)
    # blind: the least-loaded node (d3 and d4 tie, the request's hash picks d4), no tokens held
    assert keep_receiver(s, False) == ("d4", 0)
    # aware: d0 and d4 hold 100 tokens; d4 is the less loaded of the two
    assert keep_receiver(s, True) == ("d4", 100)
    # the held prefix is capped as the engines compute it: ℓ = 80 → 79
    assert keep_receiver(snap(decode=DECODE, prompt=80), True) == ("d4", 79)


def test_deflect_target_avoids_nodes_with_a_deflection_in_flight():
    free = DecodeNodeView(id="free", batch_size=9, kv_tokens=9000)
    flagged = DecodeNodeView(id="flagged", batch_size=1, kv_tokens=10, deflection_in_flight=True)
    listed = DecodeNodeView(id="listed", batch_size=1, kv_tokens=10, in_flight=[InFlightDeflection(prompt_tokens=5)])
    assert deflect_target(snap(decode=[flagged, listed, free])) == "free"
    # every node busy: the least loaded (KV, then batch), first listed on ties
    light = DecodeNodeView(id="light", batch_size=2, kv_tokens=10, deflection_in_flight=True)
    assert deflect_target(snap(decode=[light, flagged, listed])) == "flagged"
    assert deflect_target(snap(decode=[free, DecodeNodeView(id="small", batch_size=1, kv_tokens=9000)])) == "small"


def test_the_kv_estimate_uses_the_link_the_params_name():
    # a second link, "slow": 5 ms + t·1000 B / 0.1 GB/s = 5 + t/100 ms; ℓ = 250 → 7.5 ms (the
    # default link "l": 1 + 250/1000 = 1.25 ms)
    from kairos.core.model.latency import LinkModel

    two = tiny_model(links={"l": LinkModel(bandwidth_gb_s=1.0, setup_ms=1.0),
                            "slow": LinkModel(bandwidth_gb_s=0.1, setup_ms=5.0)})
    assert best_prefill(snap(), two, PolicyParams())[2] == pytest.approx(1.25)
    assert best_prefill(snap(), two, PolicyParams(link="slow"))[2] == pytest.approx(7.5)
    # with the KV term on (kairos+), the link's time is in TTFT_pf too: 7.5 − 1.25 = 6.25 ms more
    fast_link = best_prefill(snap(), two, PolicyParams(), include_kv=True)[1]
    assert best_prefill(snap(), two, PolicyParams(link="slow"), include_kv=True)[1] == pytest.approx(fast_link + 6.25)


def test_best_prefill_names_a_node_when_every_ttft_overflows():
    """Queues of 10^200 tokens (a snapshot built in memory: the heartbeat and the JSON snapshot refuse
    them) make every TTFT_pf infinite: the node listed first is chosen, never no node ('')."""
    huge = [PrefillNodeView(id="p0", queue_prompt_tokens=[10 ** 200]),
            PrefillNodeView(id="p1", queue_prompt_tokens=[10 ** 200])]
    node, ttft, _ = best_prefill(snap(prefill=huge), M, PolicyParams())
    assert (node, ttft) == ("p0", float("inf"))
    node, ttft, _ = best_prefill(snap(prefill=[huge[0], PrefillNodeView(id="p1")]), M, PolicyParams())
    assert node == "p1" and ttft < float("inf")
