"""The ingress's per-request state machine (shared/lifecycle.py), without HTTP or a bus."""

from __future__ import annotations

from shared.lifecycle import Complete, Fail, Ignore, Phase, Relay, RequestLifecycle, Resubmit
from shared.wire import DoneEvent, ErrorEvent, TokenEvent


def tok(rid: str, i: int, node: str = "decode-0", count: int = 1) -> TokenEvent:
    return TokenEvent(request_id=rid, first_index=i, count=count, text=f" t{i}", node=node, sent_unix_ms=0.0)


def done(rid: str, n: int, node: str = "decode-0") -> DoneEvent:
    return DoneEvent(request_id=rid, completion_tokens=n, node=node, sent_unix_ms=0.0)


def test_happy_path_queued_routed_streaming_done():
    lc = RequestLifecycle("r")
    assert lc.phase is Phase.QUEUED and lc.depends_on() is None
    lc.on_routed("r", "deflect", "decode-0")
    assert lc.phase is Phase.ROUTED and lc.depends_on() == "decode-0"
    for i in range(3):
        assert isinstance(lc.on_token(tok("r", i), True), Relay)
    assert lc.phase is Phase.STREAMING
    out = lc.on_done(done("r", 3), True)
    assert out == Complete("length", 3) and lc.ended
    assert isinstance(lc.on_token(tok("r", 3), True), Ignore)  # nothing after the end


def test_tokens_of_a_second_execution_are_never_relayed():
    lc = RequestLifecycle("r")
    assert isinstance(lc.on_token(tok("r", 0, "decode-0"), True), Relay)
    # the same bus id executing on another node: dropped, whatever its indices
    assert lc.on_token(tok("r", 1, "decode-1"), True) == Ignore("foreign_node")
    assert lc.on_done(done("r", 5, "decode-1"), True) == Ignore("foreign_node")
    assert isinstance(lc.on_token(tok("r", 1, "decode-0"), True), Relay)
    assert lc.on_done(done("r", 2, "decode-0"), True) == Complete("length", 2)
    assert lc.dropped == {"foreign_node": 2}


def test_duplicates_dropped_gaps_interrupt():
    lc = RequestLifecycle("r", max_resubmits=1)
    lc.on_token(tok("r", 0), True)
    lc.on_token(tok("r", 1), True)
    assert lc.on_token(tok("r", 1), True) == Ignore("duplicate")
    out = lc.on_token(tok("r", 5), True)  # 2..4 lost (bus outage): nothing reached the client yet
    assert isinstance(out, Resubmit) and out.new_attempt_id == "r-r1" and out.why.startswith("stream_interrupted")
    assert lc.received == 0 and lc.phase is Phase.QUEUED and lc.token_node is None


def test_done_with_missing_tokens_is_an_interruption():
    lc = RequestLifecycle("r", max_resubmits=0)
    lc.on_token(tok("r", 0), True)
    out = lc.on_done(done("r", 4), True)
    assert isinstance(out, Fail) and out.code == "stream_interrupted" and out.status == 503


def test_node_death_resubmits_until_committed_or_used_up():
    lc = RequestLifecycle("r", max_resubmits=2)
    lc.on_routed("r", "prefill", "prefill-0")
    assert lc.on_node_dead("decode-1", True) == Ignore("not_dependent")  # keep path before the handoff
    out = lc.on_node_dead("prefill-0", True)
    assert out == Resubmit("r", "r-r1", "node_lost:prefill-0")
    # late events of the abandoned attempt are dropped
    assert lc.on_token(tok("r", 0), True) == Ignore("old_attempt")
    assert isinstance(lc.on_error(ErrorEvent(request_id="r", status=503, code="x", message="", source="s",
                                             sent_unix_ms=0)), Ignore)
    lc.on_routed("r-r1", "prefill", "prefill-1")
    lc.on_handoff("r-r1", "decode-0")
    assert lc.depends_on() == "decode-0"
    assert lc.on_node_dead("prefill-1", True) == Ignore("not_dependent")  # the KV is on decode-0 now
    assert lc.on_node_dead("decode-0", True) == Resubmit("r-r1", "r-r2", "node_lost:decode-0")
    lc.on_routed("r-r2", "deflect", "decode-1")
    out = lc.on_node_dead("decode-1", True)  # re-submissions used up
    assert isinstance(out, Fail) and out.code == "node_lost" and "re-submitted 2 time(s)" in out.message
    assert out.attempt_id == "r-r2" and out.cancel


def test_committed_stream_cannot_move():
    lc = RequestLifecycle("r")
    lc.on_token(tok("r", 0), True)
    lc.committed_to_client()
    out = lc.on_node_dead("decode-0", True)
    assert isinstance(out, Fail) and out.code == "node_lost" and "already sent" in out.message


def test_no_time_left_ends_instead_of_resubmitting():
    lc = RequestLifecycle("r")
    lc.on_routed("r", "deflect", "decode-0")
    out = lc.on_node_dead("decode-0", time_left=False)
    assert isinstance(out, Fail) and "no time left" in out.message


def test_errors_timeouts_and_shutdown_end_it():
    lc = RequestLifecycle("r")
    out = lc.on_error(ErrorEvent(request_id="r", status=503, code="no_available_node", message="m",
                                 source="dispatcher:x", sent_unix_ms=0))
    assert out == Fail(503, "no_available_node", "m", "r", cancel=True) and lc.ended  # late acceptances stop
    assert RequestLifecycle("a").on_timeout(True).status == 504
    assert RequestLifecycle("a").on_shutdown().code == "ingress_shutdown"
    assert RequestLifecycle("a").on_bus_unavailable(9.0).code == "bus_unavailable"
    assert RequestLifecycle("a").on_client_gone().status == 499


def test_a_restarted_agent_reporting_node_lost_moves_the_request():
    lc = RequestLifecycle("r")
    lc.on_routed("r", "deflect", "decode-0")
    out = lc.on_error(ErrorEvent(request_id="r", status=503, code="node_lost", message="restarted",
                                 source="node_agent:decode-0", sent_unix_ms=0))
    assert isinstance(out, Resubmit) and out.new_attempt_id == "r-r1"
