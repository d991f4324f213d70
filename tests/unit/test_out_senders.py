"""Which senders the ingress accepts an attempt's out events from (kairos/services/ingress/senders.py)."""

from __future__ import annotations

from kairos.services.ingress.senders import HOLD_MAX, Senders
from kairos.contracts import subjects as S
from kairos.contracts.events import DoneEvent, ErrorEvent, HandoffEvent, TokenEvent

RID = "cmpl-1"


def tok(node: str, i: int = 0, text: str = "x") -> TokenEvent:
    return TokenEvent(request_id=RID, first_index=i, count=1, text=text, node=node, sent_unix_ms=1.0)


def err(source: str) -> ErrorEvent:
    return ErrorEvent(request_id=RID, status=503, code="c", message="m", source=source, sent_unix_ms=1.0)


def handoff(node: str, decode: str) -> HandoffEvent:
    return HandoffEvent(request_id=RID, node=node, decode_node=decode, sent_unix_ms=1.0)


def judge(s: Senders, user: str, ev) -> str | None:
    return s.judge(S.out_subject(RID, user), user, ev)


def test_the_out_subject_names_request_and_sender():
    assert S.out_subject(RID, "agent-decode-0") == "kairos.out.cmpl-1.agent-decode-0"
    assert S.out_origin("kairos.out.cmpl-1.agent-decode-0") == (RID, "agent-decode-0")
    for other in ("kairos.out.cmpl-1", "kairos.state.decode-0", "$KV.kairos_requests.cmpl-1.claim",
                  "kairos.out.cmpl-1.a.b"):
        assert S.out_origin(other) is None


def test_a_deflection_accepts_its_node_and_dispatcher_errors_only():
    s = Senders(RID)
    s.routed("decode-1", "deflect")
    assert judge(s, "agent-decode-1", tok("decode-1")) is None
    assert judge(s, "agent-decode-1", err("node_agent:decode-1")) is None
    assert judge(s, "dispatcher", err("dispatcher:d-0")) is None
    assert judge(s, "dispatcher", tok("decode-1")) == "dispatcher_sends_only_errors"
    assert judge(s, "ingress", tok("decode-1")) == "not_a_node"
    assert judge(s, "agent-decode-1", tok("decode-0")) == "names_another_node"
    assert judge(s, "agent-decode-1", err("node_agent:decode-0")) == "names_another_node"
    assert judge(s, "agent-decode-1", handoff("decode-1", "decode-0")) == "not_the_prefill_node"
    assert judge(s, "agent-decode-0", tok("decode-0")) == "held"  # another agent: never released
    assert s.release() == ([], []) and len(s.refuse_held()) == 1 and s.held == []


def test_keep_path_the_prefill_node_names_the_decode_node_whose_early_tokens_are_replayed_in_order():
    s = Senders(RID)
    # decode-1's tokens and the prefill node's handoff event overtake the routing event
    assert judge(s, "agent-decode-1", tok("decode-1", 0, "a")) == "held"
    assert judge(s, "agent-decode-0", tok("decode-0", 0, "FORGED")) == "held"
    assert judge(s, "agent-prefill-0", handoff("prefill-0", "decode-1")) == "held"
    assert judge(s, "agent-decode-1", tok("decode-1", 1, "b")) == "held"
    s.routed("prefill-0", "keep")
    ok, refused = s.release()
    assert ok == [handoff("prefill-0", "decode-1"), tok("decode-1", 0, "a"), tok("decode-1", 1, "b")]
    assert refused == [] and [h.event.text for h in s.refuse_held()] == ["FORGED"]
    assert judge(s, "agent-decode-1", DoneEvent(request_id=RID, completion_tokens=2, node="decode-1",
                                                 sent_unix_ms=1.0)) is None


def test_a_decode_node_cannot_name_another_one_and_the_hold_is_bounded():
    s = Senders(RID)
    s.routed("prefill-0", "keep")
    assert judge(s, "agent-prefill-0", handoff("prefill-0", "decode-1")) is None
    assert judge(s, "agent-decode-1", handoff("decode-1", "decode-0")) == "not_the_prefill_node"
    for _ in range(HOLD_MAX):
        assert judge(s, "agent-decode-0", tok("decode-0")) == "held"
    assert judge(s, "agent-decode-0", tok("decode-0")) == "not_the_jobs_node"


def test_a_new_attempt_starts_with_no_accepted_sender():
    """A lost node's re-submission is a new bus id: the old attempt's nodes are not accepted for it."""
    old = Senders(RID)
    old.routed("decode-0", "deflect")
    new = Senders(RID + "-r1")
    assert judge(new, "agent-decode-0", tok("decode-0")) == "held"
    new.routed("decode-1", "deflect")
    assert new.release() == ([], []) and len(new.refuse_held()) == 1
