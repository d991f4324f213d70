"""Deflection slots: reservation keys, the snapshot a dispatcher builds from them, agent refusals."""

import msgspec
import pytest

from kairos.contracts import subjects as S
from kairos.core.cluster.routing import build_snapshot, job_refusal
from kairos.contracts.wire import ClusterView, InferenceRequest, NodeView, Reservation


def node(name, role):
    return NodeView(node=name, role=role, stale=False, age_ms=10.0, accepting=True, batch_size=4, kv_tokens=4000,
                    queue_prompt_tokens=[], deflection_in_flight=False, in_flight=[], waiting=0, kv_backlog_ms=0.0,
                    pending_routed=0)


VIEW = ClusterView(seq=1, built_unix_ms=1000.0, period_ms=100.0, stale_after_ms=300.0,
                   nodes=[node("prefill-0", "prefill"), node("decode-0", "decode"), node("decode-1", "decode")])


def resv(rid, dn, prompt=500, created=1.0):
    return Reservation(request_id=rid, decode_node=dn, dispatcher_id="d", prompt_tokens=prompt, output_tokens=7,
                       created_unix_ms=created, expires_unix_ms=1e12)


def request(rid="r"):
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=100, max_tokens=5, created_unix_ms=0.0,
                            deadline_unix_ms=1e12)


def test_keys_round_trip_and_reject_foreign_keys():
    assert S.reservation_key("decode-3", 2) == "decode.decode-3.2"
    assert S.node_of_reservation_key("decode.decode-3.2") == "decode-3"
    assert S.node_of_reservation_key("decode.decode-3") is None and S.node_of_reservation_key("x.y.1") is None
    with pytest.raises(S.SubjectError):
        S.reservation_key("decode-0", -1)


def test_a_bad_id_is_quoted_whole_when_short_and_clipped_when_huge():
    with pytest.raises(S.SubjectError, match=r"request id 'a\.b' must match"):
        S.check_token("a.b", "request id")
    with pytest.raises(S.SubjectError) as err:
        S.check_token("x" * 5000 + ".", "request id")
    msg = str(err.value)
    assert len(msg) < 300 and "5001 characters" in msg and "x" * 128 in msg


def test_one_slot_node_with_a_reservation_is_in_flight_without_projection_data():
    held = {S.reservation_key("decode-0"): resv("other", "decode-0")}
    snap = build_snapshot(request(), VIEW, held, {}, 2000.0)
    d0, d1 = snap.decode_nodes
    assert d0.deflection_in_flight and d0.in_flight == []
    assert not d1.deflection_in_flight


def test_spare_slots_expose_the_reservations_as_in_flight_deflections_oldest_first():
    held = {S.reservation_key("decode-0", 1): resv("b", "decode-0", 800, created=2.0),
            S.reservation_key("decode-0", 0): resv("a", "decode-0", 300, created=1.0)}
    snap = build_snapshot(request(), VIEW, held, {}, 2000.0, max_deflections=3)
    d0 = snap.decode_nodes[0]
    assert d0.deflection_in_flight and [f.prompt_tokens for f in d0.in_flight] == [300, 800]
    full = build_snapshot(request(), VIEW, held, {}, 2000.0, max_deflections=2)
    assert full.decode_nodes[0].in_flight == []  # no slot left: no policy may deflect there
    # the request's own reservation does not count; a node this request met as full stays full
    own = {S.reservation_key("decode-1"): resv("r", "decode-1")}
    snap = build_snapshot(request("r"), VIEW, own, {}, 2000.0, full={"decode-0"})
    assert not snap.decode_nodes[1].deflection_in_flight and snap.decode_nodes[0].deflection_in_flight


@pytest.mark.parametrize("deflecting,slots,refused", [(0, 1, False), (1, 1, True), (1, 2, False), (2, 2, True)])
def test_agent_refuses_a_deflection_beyond_its_slots(deflecting, slots, refused):
    why = job_refusal("deflect", "decode-0", "decode-0", "decode", True, deflecting, 100, 5, 32768, 1e12, 0.0,
                      max_deflections=slots)
    assert (why == "deflection_in_flight") is refused


def routed(rid, node, accepted, prompt=1000, kind="keep"):
    from kairos.contracts.wire import RoutedEvent

    return RoutedEvent(request_id=rid, kind=kind, node=node, decode_node="decode-0", prompt_tokens=prompt,
                       output_tokens=5, node_accepted_unix_ms=accepted)


def test_fold_recent_adds_only_jobs_the_view_does_not_have_yet():
    from kairos.core.cluster.routing import fold_recent

    p0 = msgspec.structs.replace(VIEW.nodes[0], state_sent_unix_ms=500.0, queue_prompt_tokens=[700],
                                 pending_ids=["seen"], pending_routed=1)
    view = msgspec.structs.replace(VIEW, nodes=[p0, *VIEW.nodes[1:]])
    events = [routed("old", "prefill-0", 400.0),      # accepted before the node's state: in its queue
              routed("seen", "prefill-0", 600.0),     # already folded in by the aggregator
              routed("new", "prefill-0", 650.0, 2000),
              routed("d", "decode-0", 650.0, kind="deflect")]  # reservations carry deflections
    out = fold_recent(view, events)
    assert out.nodes[0].queue_prompt_tokens == [700, 2000] and out.nodes[0].pending_ids == ["seen", "new"]
    # the decode node they named cannot show them before their prefill ends: every keep job its
    # prefill node has not reported yet ("seen" and "new", not "old") adds its prompt and one to the batch
    d0 = view.nodes[1]
    assert out.nodes[1] == msgspec.structs.replace(d0, kv_tokens=d0.kv_tokens + 3000, batch_size=d0.batch_size + 2)
    assert out.nodes[2:] == view.nodes[2:]
    assert fold_recent(view, []) is view and fold_recent(None, events) is None


def test_fold_recent_spreads_a_burst_over_equally_loaded_decode_nodes():
    from kairos.contracts.wire import RoutedEvent
    from kairos.core.cluster.routing import build_snapshot, fold_recent
    from kairos.core.policy.common import least_loaded_decode

    # one replica routes a burst between two views, remembering each keep job it sends (its
    # provisional event): each choice sees the earlier ones on their decode nodes
    nodes = [node("prefill-0", "prefill"), *(node(f"decode-{i}", "decode") for i in range(4))]
    view = msgspec.structs.replace(VIEW, nodes=nodes)
    recent, picks = [], []
    for i in range(8):
        snap = build_snapshot(request(f"burst-{i}"), fold_recent(view, recent), {}, {}, 1000.0)
        picks.append(least_loaded_decode(snap))
        recent.append(RoutedEvent(request_id=f"burst-{i}", kind="keep", node="prefill-0", decode_node=picks[-1],
                                  prompt_tokens=100, output_tokens=5, node_accepted_unix_ms=float("inf")))
    assert sorted(picks.count(f"decode-{i}") for i in range(4)) == [2, 2, 2, 2], picks
