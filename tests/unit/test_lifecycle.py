"""The ingress's per-request state machine (kairos/services/ingress/lifecycle.py), without HTTP or a bus."""

from __future__ import annotations

from kairos.services.ingress.lifecycle import (Attempt, Complete, Fail, Ignore, Migrate, Phase, Relay, RequestLifecycle,
                                               Resubmit)
from kairos.contracts.events import DoneEvent, ErrorEvent, TokenEvent


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
    lc.on_routed("r", "keep", "prefill-0")
    assert lc.on_node_dead("decode-1", True) == Ignore("not_dependent")  # keep path before the handoff
    out = lc.on_node_dead("prefill-0", True)
    assert out == Resubmit("r", "r-r1", "node_lost:prefill-0")
    # late events of the abandoned attempt are dropped
    assert lc.on_token(tok("r", 0), True) == Ignore("old_attempt")
    assert isinstance(lc.on_error(ErrorEvent(request_id="r", status=503, code="x", message="", source="s",
                                             sent_unix_ms=0)), Ignore)
    lc.on_routed("r-r1", "keep", "prefill-1")
    lc.on_handoff("r-r1", "decode-0")
    assert lc.depends_on() == "decode-0"
    assert lc.on_node_dead("decode-1", True) == Ignore("not_dependent")
    assert lc.on_node_dead("decode-0", True) == Resubmit("r-r1", "r-r2", "node_lost:decode-0")
    lc.on_routed("r-r2", "deflect", "decode-1")
    out = lc.on_node_dead("decode-1", True)  # re-submissions used up
    assert isinstance(out, Fail) and out.code == "node_lost" and "re-submitted 2 time(s)" in out.message
    assert out.attempt_id == "r-r2" and out.cancel


def test_committed_stream_cannot_move_with_migration_off():
    lc = RequestLifecycle("r", max_migrations=0)
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


def err(rid: str, code: str, message: str = "m", source: str = "node_agent:decode-0") -> ErrorEvent:
    return ErrorEvent(request_id=rid, status=503, code=code, message=message, source=source, sent_unix_ms=0)


def test_a_dispatchers_routing_failure_of_a_duplicate_copy_leaves_the_accepted_attempt_alone():
    # a copy of the attempt (redelivered, or left on a request lane it moved from) failed to route while
    # a node runs the attempt: the stream goes on; before any node accepted it, the same error ends it
    for before in ("routed", "streaming"):
        lc = RequestLifecycle("r")
        lc.on_routed("r", "deflect", "decode-0")
        if before == "streaming":
            assert isinstance(lc.on_token(tok("r", 0), True), Relay)
        assert lc.on_error(err("r", "no_available_node", source="dispatcher:d-1")) == Ignore("routed_elsewhere")
        assert not lc.ended and isinstance(lc.on_token(tok("r", 1 if before == "streaming" else 0), True), Relay)
    lc = RequestLifecycle("r")
    lc.on_routed("r", "deflect", "decode-0")
    assert isinstance(lc.on_error(err("r", "no_available_node", source="node_agent:decode-0")), Fail)  # a node's own
    # error still ends it, unless it says another node could finish the attempt (MOVABLE_CODES)


def test_a_kv_handoff_nobody_took_is_submitted_again_and_at_the_limit_ends_with_its_code():
    # the prefill node found every decode candidate of its job draining or gone (a rolling restart):
    # the dispatchers route the attempt again; after max_resubmits the client gets kv_handoff_failed
    lc = RequestLifecycle("r", max_resubmits=1)
    lc.on_routed("r", "keep", "prefill-0")
    assert lc.on_error(err("r", "kv_handoff_failed", source="node_agent:prefill-0")) == Resubmit(
        "r", "r-r1", "kv_handoff_failed:node_agent:prefill-0")
    lc.on_routed("r-r1", "keep", "prefill-0")
    out = lc.on_error(err("r-r1", "kv_handoff_failed", "no decode node took it", source="node_agent:prefill-0"))
    assert isinstance(out, Fail) and out.code == "kv_handoff_failed" and "re-submitted 1 time(s)" in out.message, out
    # a dispatcher cannot send this code; from anything but a node agent it ends the request as before
    lc = RequestLifecycle("r")
    assert isinstance(lc.on_error(err("r", "kv_handoff_failed", source="dispatcher:d-0")), Fail)


def test_events_after_the_end_or_of_another_attempt_change_nothing():
    lc = RequestLifecycle("r", max_resubmits=1)
    assert lc.on_routed("r", "keep", "prefill-0") == Ignore("state_only")
    assert lc.on_node_dead("prefill-0", True) == Resubmit("r", "r-r1", "node_lost:prefill-0")
    assert lc.on_routed("r", "deflect", "decode-9") == Ignore("old_attempt")  # the abandoned attempt
    lc.on_handoff("r", "decode-9")
    assert (lc.phase, lc.node, lc.handoff_node) == (Phase.QUEUED, None, None)
    assert lc.on_error(err("r", "x")) == Ignore("old_attempt")
    ev = tok("r-r1", 0)
    assert lc.on_token(ev, True) == Relay(ev)
    assert lc.on_done(DoneEvent(request_id="r-r1", completion_tokens=1, node="decode-0", sent_unix_ms=0.0,
                                cached_tokens=7), True) == Complete("length", 1, 7)
    for late in (lambda: lc.on_routed("r-r1", "deflect", "decode-1"), lambda: lc.on_token(tok("r-r1", 1), True),
                 lambda: lc.on_done(done("r-r1", 1), True), lambda: lc.on_error(err("r-r1", "x")),
                 lambda: lc.interrupted("late", True)):
        assert late() == Ignore("ended")
    lc.on_handoff("r-r1", "decode-5")
    assert (lc.phase, lc.node, lc.handoff_node) == (Phase.ENDED, None, None)  # r-r1 was never routed
    assert lc.dropped == {"old_attempt": 2, "ended": 5}


def test_interruptions_resubmit_with_their_detail_then_fail_with_it():
    lc = RequestLifecycle("r", max_resubmits=2)
    lc.on_token(tok("r", 0), True)
    lc.on_token(tok("r", 1), True)
    # tokens 1..3 when 2 arrived: 1 + 3 = 4 > 2, so not a duplicate but an overlap
    assert lc.on_token(tok("r", 1, count=3), True) == Resubmit("r", "r-r1", "stream_interrupted:overlapping tokens "
                                                                             "1..3 after 2")
    lc.on_token(tok("r-r1", 0), True)
    assert lc.on_done(done("r-r1", 4), True) == Resubmit("r-r1", "r-r2",
                                                         "stream_interrupted:done after 4 tokens, 1 arrived")
    lc.on_token(tok("r-r2", 0), True)
    assert lc.on_token(tok("r-r2", 3), True) == Fail(
        503, "stream_interrupted", "the token stream of request r was interrupted (tokens 1..2 never arrived; a "
        "message-bus outage) and the request cannot be moved: re-submitted 2 time(s) already", "r-r2")


def test_failure_messages_say_what_happened():
    lc = RequestLifecycle("r")
    lc.on_routed("r", "deflect", "decode-0")
    assert lc.on_node_dead("decode-0", False) == Fail(
        503, "node_lost", "node decode-0 serving request r was lost (no heartbeat and no token; it may have crashed) "
        "and the request cannot be moved: no time left", "r")
    lc = RequestLifecycle("r", max_migrations=0)
    lc.committed_to_client()
    assert lc.on_error(err("r", "node_lost", "restarted")) == Fail(
        503, "node_lost", "restarted: output was already sent to the client", "r")
    lc = RequestLifecycle("r")
    assert lc.on_error(err("r", "node_lost", source="node_agent:decode-3")) == Resubmit(
        "r", "r-r1", "node_lost:node_agent:decode-3")
    assert RequestLifecycle("a").on_timeout(True) == Fail(504, "timeout", "request a timed out before its first token",
                                                          "a")
    assert RequestLifecycle("a").on_timeout(False) == Fail(504, "timeout", "request a timed out waiting for tokens",
                                                           "a")
    assert RequestLifecycle("a").on_bus_unavailable(9.04) == Fail(
        503, "bus_unavailable", "the message bus has been unreachable for 9.0 s; request a cannot be served now, "
        "retry it", "a")
    assert RequestLifecycle("a").on_shutdown() == Fail(
        503, "ingress_shutdown", "the ingress serving request a is shutting down; retry the request", "a")
    assert RequestLifecycle("a").on_client_gone() == Fail(499, "client_disconnected", "client closed the connection",
                                                          "a")
    assert all(f.cancel for f in (RequestLifecycle("a").on_client_gone(), RequestLifecycle("a").on_timeout(True)))



def streamed(lc: RequestLifecycle, node: str, n: int, first: int = 0) -> None:
    """``n`` tokens of ``lc``'s current attempt from ``node`` relayed and sent to the client."""
    for i in range(first, first + n):
        assert isinstance(lc.on_token(tok(lc.attempt_id, i, node), True), Relay)
    lc.committed_to_client()


def test_a_committed_stream_migrates_after_the_tokens_sent_and_counts_every_attempt():
    """Issue 33: the node of a streaming request dies after 3 tokens reached the client: the request
    continues as r-m1, resuming after them (their text), and its usage counts both attempts."""
    lc = RequestLifecycle("r", max_tokens=10)
    lc.on_routed("r", "deflect", "decode-0")
    streamed(lc, "decode-0", 3)
    out = lc.on_node_dead("decode-0", True)
    assert out == Migrate("r", "r-m1", "node_lost:decode-0", 3, " t0 t1 t2", None)
    assert (lc.phase, lc.delivered, lc.received, lc.token_node) == (Phase.QUEUED, 3, 0, None)
    assert lc.on_token(tok("r", 3, "decode-0"), True) == Ignore("old_attempt")  # the old node's late tokens
    lc.on_routed("r-m1", "keep", "prefill-0")
    lc.on_handoff("r-m1", "decode-1")
    assert lc.depends_on() == "decode-1"
    assert isinstance(lc.on_token(tok("r-m1", 0, "decode-1"), True), Relay)  # the new attempt counts from 0
    streamed(lc, "decode-1", 6, first=1)
    assert lc.on_done(done("r-m1", 7, "decode-1"), True) == Complete("length", 10)
    assert lc.attempts == [Attempt("r", "decode-0", 3, "node_lost:decode-0")]
    assert lc.attempt_record() == Attempt("r-m1", "decode-1", 7)


def test_migration_carries_token_ids_only_when_every_event_had_them():
    lc = RequestLifecycle("r", max_tokens=8)
    for i in range(2):
        lc.on_token(TokenEvent(request_id="r", first_index=i, count=1, text=f" w{i}", node="d", sent_unix_ms=0.0,
                               token_ids=[100 + i]), True)
    lc.committed_to_client()
    assert lc.on_node_dead("d", True).output_token_ids == [100, 101]
    lc.on_token(TokenEvent(request_id="r-m1", first_index=0, count=1, text=" w2", node="e", sent_unix_ms=0.0), True)
    assert lc.on_node_dead("e", True) == Migrate("r-m1", "r-m2", "node_lost:e", 3, " w0 w1 w2", None)


def test_drained_or_failed_nodes_migrate_and_a_dispatchers_error_does_not():
    lc = RequestLifecycle("r", max_tokens=5)
    streamed(lc, "decode-0", 1)
    assert isinstance(lc.on_error(err("r", "node_shutdown", source="node_agent:decode-0")), Migrate)
    streamed(lc, "decode-1", 1)
    assert isinstance(lc.on_error(err("r-m1", "engine_error", source="node_agent:decode-1")), Migrate)
    assert lc.phase is Phase.QUEUED  # r-m2, not routed: a dispatcher finding no node ends it
    assert isinstance(lc.on_error(err("r-m2", "no_available_node", source="dispatcher:d0")), Fail)
    # before any output an engine failure ends the request (the backend retried already)
    fresh = RequestLifecycle("x")
    assert isinstance(fresh.on_error(err("x", "engine_error", source="node_agent:decode-0")), Fail)


def test_the_migration_limit_ends_the_request_naming_its_attempts():
    lc = RequestLifecycle("r", max_migrations=2, max_tokens=50)
    streamed(lc, "decode-0", 1)
    assert isinstance(lc.on_node_dead("decode-0", True), Migrate)
    streamed(lc, "decode-1", 1)
    assert isinstance(lc.on_node_dead("decode-1", True), Migrate)
    streamed(lc, "decode-0", 1)
    out = lc.on_node_dead("decode-0", True)
    assert isinstance(out, Fail) and out.code == "migration_limit" and out.status == 503, out
    assert "already moved 2 time(s) (attempts: r, r-m1, r-m2)" in out.message and lc.ended


def test_a_lost_done_after_the_last_token_completes_instead_of_migrating():
    """The last token event carried the finish reason; the node died before its done: complete."""
    lc = RequestLifecycle("r", max_tokens=9)
    lc.on_token(TokenEvent(request_id="r", first_index=0, count=2, text=" a b", node="d", sent_unix_ms=0.0,
                           finish_reason="stop", stop_reason="c"), True)
    lc.committed_to_client()
    assert lc.on_node_dead("d", True) == Complete("stop", 2, 0, "c") and lc.ended
    # all of max_tokens delivered, no finish reason seen: complete with length
    lc = RequestLifecycle("r", max_tokens=2)
    streamed(lc, "d", 2)
    assert lc.on_node_dead("d", True) == Complete("length", 2)
    # no time left: an error, as before
    lc = RequestLifecycle("r", max_tokens=9)
    streamed(lc, "d", 1)
    assert isinstance(lc.on_node_dead("d", False), Fail)



def test_a_prefill_node_lost_after_its_handoff_before_the_first_token_resubmits():
    """Issue 33: the KV went to decode-0, which has sent no token: it may still be pulling from prefill-0.
    prefill-0's death then loses the attempt (re-submitted: nothing reached the client); once decode-0
    streams, the KV is there and prefill-0 no longer matters."""
    lc = RequestLifecycle("r")
    lc.on_routed("r", "keep", "prefill-0")
    lc.on_handoff("r", "decode-0")
    assert lc.on_node_dead("prefill-0", True) == Resubmit("r", "r-r1", "node_lost:prefill-0")
    lc.on_routed("r-r1", "keep", "prefill-1")
    lc.on_handoff("r-r1", "decode-1")
    assert isinstance(lc.on_token(tok("r-r1", 0, "decode-1"), True), Relay)
    assert lc.on_node_dead("prefill-1", True) == Ignore("not_dependent")


def test_the_record_names_the_node_each_attempt_depended_on_and_why_it_was_left():
    """The request record's attempts (``GET /v1/requests/{id}``): each names the node the attempt was on —
    its token node once it streamed, else the decode node that took the KV, else the node that accepted
    it — and why it was left, for a re-submission as for a migration."""
    lc = RequestLifecycle("r", max_resubmits=2)
    lc.on_routed("r", "keep", "prefill-0")
    assert lc.depends_on() == "prefill-0"  # keep path before the handoff: the prefill node
    lc.on_handoff("r", "decode-0")
    assert lc.attempt_record() == Attempt("r", "decode-0", 0)
    assert isinstance(lc.on_node_dead("decode-0", True), Resubmit)
    assert lc.attempts == [Attempt("r", "decode-0", 0, "node_lost:decode-0")]
    # keep path whose handoff record never came: the tokens say where it runs
    lc.on_routed("r-r1", "keep", "prefill-1")
    assert isinstance(lc.on_token(tok("r-r1", 0, "decode-1"), True), Relay)
    assert lc.attempt_record() == Attempt("r-r1", "decode-1", 1)


def test_one_migration_allowed_ends_the_second_loss_with_the_limit_and_records_it():
    lc = RequestLifecycle("r", max_migrations=1, max_tokens=50)
    streamed(lc, "decode-0", 1)
    assert isinstance(lc.on_node_dead("decode-0", True), Migrate)
    streamed(lc, "decode-1", 2)
    out = lc.on_node_dead("decode-1", True)
    assert isinstance(out, Fail) and out.code == "migration_limit", out
    assert lc.attempts[-1] == Attempt("r-m1", "decode-1", 2, "node_lost:decode-1")


def test_a_stream_lost_after_max_tokens_completes_and_ends():
    lc = RequestLifecycle("r", max_tokens=2)
    streamed(lc, "d", 2)
    assert lc.on_node_dead("d", True) == Complete("length", 2)
    assert lc.ended and lc.on_token(tok("r", 2, "d"), True) == Ignore("ended")
