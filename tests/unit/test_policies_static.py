"""pd, sq:θ, sl:ℓ, dynamo and the policy-spec parser."""

import pytest

from kairos.core.policy import POLICIES

from kairos.core.policy import PolicyError

from kairos.core.policy import PolicyParams

from kairos.core.policy import parse_policies

from kairos.core.policy import parse_policy
from tests.factories import snapshot, tiny_model

M = tiny_model()
P = PolicyParams(prefill_chunk_tokens=100)


def test_pd_never_deflects():
    d = parse_policy("pd").decide(snapshot(50, [[10_000]], [(0, 0, False)]), M, P)
    assert d.decision == "keep" and d.reason == "pd_never_deflects" and d.chunk_schedule == []


@pytest.mark.parametrize("queues,deflect", [
    ([[1, 1], [1, 1]], True),       # every node holds 2 > θ=1
    ([[1, 1], [1]], False),         # one node holds only 1
    ([[1, 0], [1, 1]], False),      # zero-token entries are not requests with work left
])
def test_sq_threshold_on_all_prefill_nodes(queues, deflect):
    d = parse_policy("sq:1").decide(snapshot(500, queues, [(4, 100, False), (1, 10, False)]), M, P)
    assert d.deflected is deflect
    if deflect:
        assert d.node == "decode-1"  # least loaded
        # fixed χ = 128 with B = 1 → 127 prompt tokens per step → ⌈500/127⌉ = 4 steps
        assert d.chunk_schedule == [128] * 4 and len(d.predicted_step_ms) == 4


@pytest.mark.parametrize("prompt,deflect", [(1023, True), (1024, False), (5000, False)])
def test_sl_prompt_length(prompt, deflect):
    d = parse_policy("sl:1024").decide(snapshot(prompt, [[]], [(0, 0, False)]), M, P)
    assert d.deflected is deflect
    assert d.reason == ("sl_prompt_below_threshold" if deflect else "sl_prompt_not_below_threshold")


def test_static_prefers_decode_node_without_deflection_in_flight():
    d = parse_policy("sl:1024").decide(snapshot(10, [[]], [(0, 0, True), (9, 9000, False)]), M, P)
    assert d.node == "decode-1"


@pytest.mark.parametrize("prompt,queues,reason", [
    (1000, [[]], "dynamo_short_prompt"),
    (1001, [[5, 5], [5, 5]], "dynamo_prefill_queue_full"),
    (1001, [[5, 5], [5]], "dynamo_remote_prefill"),
])
def test_dynamo_rule(prompt, queues, reason):
    d = parse_policy("dynamo").decide(snapshot(prompt, queues, [(2, 100, False)]), M, P)
    assert d.reason == reason
    assert d.deflected is (reason != "dynamo_remote_prefill")
    if d.deflected:  # local prefill with the decode engine's own token budget
        assert set(d.chunk_schedule) == {M.engine.decode_max_num_batched_tokens}


def test_dynamo_custom_thresholds():
    d = parse_policy("dynamo:10:1").decide(snapshot(11, [[5]], [(2, 100, False)]), M, P)
    assert d.reason == "dynamo_prefill_queue_full"


@pytest.mark.parametrize("spec,match", [
    ("nope", "unknown policy"), ("sl", "exactly one"), ("sl:x", "integers"), ("kairos:3", "no argument"),
    ("sq:-1", ">= 0"), ("dynamo:1:2:3", "at most two"),
])
def test_bad_specs(spec, match):
    with pytest.raises(PolicyError, match=match):
        parse_policy(spec)


def test_parse_list_and_registry():
    assert [p.spec for p in parse_policies("pd, sq:1,kairos+")] == ["pd", "sq:1", "kairos+"]
    assert {"pd", "sq", "sl", "dynamo", "kairos", "kairos+"} <= set(POLICIES)
    with pytest.raises(PolicyError):
        parse_policies(" , ")


def test_kairos_plus_turns_on_its_switches():
    pol = parse_policy("kairos+")
    pp = pol.params(PolicyParams())
    assert pp.kv_transfer_aware and pp.project_decode_state
    # kv-aware TTFT_pf adds the request's transfer: 1 ms + 400·1000 B / 1 GB/s = 1.4 ms
    snap = snapshot(400, [[]], [(10, 10_000, True)])
    plain = parse_policy("kairos").decide(snap, M, P)
    plus = pol.decide(snap, M, P)
    assert plus.ttft_prefill_est_ms == pytest.approx(plain.ttft_prefill_est_ms + 1.4)


@pytest.mark.parametrize("kw", [dict(alpha=0.9), dict(beta=0), dict(tbt_slo_ms=-1), dict(chunk_candidates=())])
def test_bad_params(kw):
    with pytest.raises(PolicyError):
        PolicyParams(**kw)
