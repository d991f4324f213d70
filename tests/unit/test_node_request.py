"""The node agent's request lifecycle (kairos/services/node_agent/request.py): every transition of each
role's path with the actions it returns, the races the agent meets (a KV-pulled notice before the
handoff's answer, vLLM's first token before the pull returns), the endings (failure, cancel, drain)
and their records, and every event a phase does not allow refused without a change."""

from __future__ import annotations

import copy

import pytest

from kairos.contracts.errors import ErrorCode
from kairos.contracts.events import DoneEvent, ErrorEvent, HandoffEvent, TokenEvent
from kairos.contracts.wire import InferenceRequest, Job, KvHandoff
from kairos.contracts.records import DecodeTiming, PrefillTiming
from kairos.core.vocabulary import RequestPhase as P
from kairos.core.vocabulary import RequestRole
from kairos.services.node_agent.request import (ALL_SPANS, EndSpan, FreeEngine, HandOff, Ignored, NodeRequest, Publish,
                                                PullKv, ReleaseSlot, Span, StartDecode, WriteRecord)

T0 = 1_000_000.0  #: wall-clock ms of the first event in each test


def request(rid: str = "r1", prompt: int = 64, out: int = 3) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=out, created_unix_ms=0.0,
                            deadline_unix_ms=1e15)


def keep() -> NodeRequest:
    job = Job(kind="keep", request=request(), node="prefill-0", decode_candidates=["decode-1", "decode-0"])
    return NodeRequest.for_job(job, "prefill-0", T0)


def deflect(predicted=(11.0, 12.0)) -> NodeRequest:
    job = Job(kind="deflect", request=request(), node="decode-0", chunk_schedule=[32, 32],
              predicted_step_ms=list(predicted))
    return NodeRequest.for_job(job, "decode-0", T0)


def remote() -> NodeRequest:
    h = KvHandoff(request=request(), src_node="prefill-0", kv_tokens=64, prefill_done_unix_ms=T0 - 5, cached_tokens=16)
    return NodeRequest.for_handoff(h, "decode-1", T0)


def kinds(actions) -> list[type]:
    return [type(a) for a in actions]


def published(actions) -> list:
    return [a.event for a in actions if isinstance(a, Publish)]


def record(actions) -> WriteRecord:
    (rec,) = [a for a in actions if isinstance(a, WriteRecord)]
    return rec


# -- creation ------------------------------------------------------------------------------------------
def test_a_job_or_a_handoff_starts_the_request_in_its_roles_first_phase():
    k, d, r = keep(), deflect(), remote()
    assert (k.role, k.phase, k.received_ms, k.job.kind) == (RequestRole.PREFILL, P.PREFILLING, T0, "keep")
    assert (d.role, d.phase) == (RequestRole.DEFLECT, P.DEFLECTED_PREFILL)
    assert (r.role, r.phase, r.src_node, r.cached_tokens, r.job) == (RequestRole.REMOTE_DECODE, P.WAITING, "prefill-0",
                                                                    16, None)
    assert k.rid == d.rid == r.rid == "r1" and not any(x.done for x in (k, d, r))


# -- keep path, prefill node -----------------------------------------------------------------------------
def test_the_prefill_node_holds_the_kv_hands_it_off_and_frees_it_when_pulled():
    r = keep()
    r.prefill_chunk_ran(T0 + 1, cached_before=32)
    r.prefill_chunk_ran(T0 + 2, cached_before=48)  # a later chunk starts nothing
    assert (r.prefill_start_ms, r.cached_tokens) == (T0 + 1, 32)
    assert r.prefill_done(T0 + 10) == [EndSpan(Span.MAIN), HandOff()]
    assert (r.phase, r.prefill_done_ms) == (P.HELD, T0 + 10)
    r.handoff_started(T0 + 11)
    r.handoff_started(T0 + 12)  # a second pass over the candidates: the hold counts from the first offer
    assert r.handoff_sent_ms == T0 + 11
    acts = r.handed_off("decode-0", T0 + 20, backlog_ms=7.5)
    assert (r.phase, r.handoff_node, r.kv_backlog_ms) == (P.HANDED_OFF, "decode-0", 7.5)
    assert published(acts) == [HandoffEvent(request_id="r1", node="prefill-0", decode_node="decode-0",
                                            sent_unix_ms=T0 + 20)]
    assert record(acts) == WriteRecord("prefill", PrefillTiming(
        node="prefill-0", received_unix_ms=T0, prefill_start_unix_ms=T0 + 1, prefill_done_unix_ms=T0 + 10,
        handoff_node="decode-0"))
    assert r.kv_pulled(4.0) == [FreeEngine(held_only=True), EndSpan(Span.HANDOFF, attrs={"kairos.kv_transfer_ms": 4.0})]
    assert (r.phase, r.pulled, r.kv_backlog_ms, r.done) == (P.GONE, True, 0.0, True)


def test_a_pulled_notice_that_overtakes_the_handoffs_answer_still_tells_the_client_which_node_decodes():
    r = keep()
    r.prefill_done(T0 + 10)
    assert kinds(r.kv_pulled(3.0)) == [FreeEngine, EndSpan] and r.phase is P.GONE
    acts = r.handed_off("decode-1", T0 + 12, backlog_ms=9.0)
    assert [type(e) for e in published(acts)] == [HandoffEvent] and record(acts).record.handoff_node == "decode-1"
    assert (r.phase, r.kv_backlog_ms) == (P.GONE, 0.0)  # nothing held here any more: no backlog


def test_a_hold_expires_only_for_a_kv_offered_before_the_limit():
    r = keep()
    assert not r.hold_expired(T0 + 1e9)  # prefilling: nothing held
    r.prefill_done(T0 + 10)
    assert not r.hold_expired(T0 + 1e9)  # held, not offered yet
    r.handoff_started(T0 + 11)
    r.handed_off("decode-0", T0 + 12, 1.0)
    assert not r.hold_expired(T0 + 11) and r.hold_expired(T0 + 11.5)
    assert r.expire_hold() == [FreeEngine(held_only=True), EndSpan(Span.HANDOFF, status="kv_pull_never_confirmed")]
    assert r.phase is P.GONE and r.kv_backlog_ms == 0.0 and not r.hold_expired(T0 + 1e9)


# -- keep path, decode node ------------------------------------------------------------------------------
def test_a_remote_decode_pulls_its_kv_then_decodes_and_finishes_with_the_prefill_nodes_cache_hit():
    r = remote()
    assert r.allocated(T0 + 1) == [PullKv()] and (r.phase, r.kv_alloc_ms) == (P.AWAITING_KV, T0 + 1)
    r.prefill_chunk_ran(T0 + 2, cached_before=63)  # its last prompt token after the pull: no prefill of this node
    assert (r.prefill_start_ms, r.cached_tokens) == (None, 16)
    assert r.kv_arrived(T0 + 5, transfer_ms=4.0) == [EndSpan(Span.MAIN, attrs={"kairos.kv_transfer_ms": 4.0}),
                                                     StartDecode()]
    assert (r.phase, r.kv_arrived_ms) == (P.DECODING, T0 + 5)
    for i, t in enumerate((T0 + 6, T0 + 9, T0 + 10)):
        assert published(r.tokens_out(i, 1, f"w{i}", t)) == [TokenEvent(request_id="r1", first_index=i, count=1,
                                                                       text=f"w{i}", node="decode-1", sent_unix_ms=t)]
    assert (r.tokens, r.first_token_ms, r.tbt_max_ms) == (3, T0 + 6, 3.0)
    acts = r.finished("length", engine_cached_tokens=48, now_ms=T0 + 11)
    assert kinds(acts) == [EndSpan, Publish, WriteRecord] and acts[0] == EndSpan(Span.DECODE)
    assert published(acts) == [DoneEvent(request_id="r1", completion_tokens=3, node="decode-1", sent_unix_ms=T0 + 11,
                                         finish_reason="length", cached_tokens=16)]  # the handoff's, not the engine's
    rec = record(acts)
    assert rec.part == "decode" and rec.record == DecodeTiming(
        node="decode-1", kind="keep", received_unix_ms=T0, kv_allocated_unix_ms=T0 + 1, kv_arrived_unix_ms=T0 + 5,
        first_token_unix_ms=T0 + 6, finished_unix_ms=T0 + 11, completion_tokens=3)
    assert r.phase is P.GONE


def test_vllms_first_token_before_the_pull_returns_is_sent_and_a_finish_then_ends_the_transfer_span():
    r = remote()
    r.allocated(T0 + 1)
    assert kinds(r.tokens_out(0, 1, "a", T0 + 3)) == [Publish] and r.phase is P.AWAITING_KV
    acts = r.finished("stop", 0, T0 + 4)
    assert acts[:2] == [EndSpan(Span.MAIN), EndSpan(Span.DECODE)] and r.phase is P.GONE
    assert kinds(r.kv_arrived(T0 + 5, 2.0)) == [Ignored]  # the pull returning late changes nothing


# -- deflect path --------------------------------------------------------------------------------------
def test_a_deflection_records_its_chunks_releases_its_slot_at_the_first_token_and_decodes():
    r = deflect(predicted=(11.0,))
    r.prefill_chunk_ran(T0 + 1, cached_before=16)
    assert r.deflected_chunk_ran(0, 32, engine_predicted_ms=9.0, actual_ms=10.5) == 11.0  # the job's Eq. 5 value
    assert r.deflected_chunk_ran(1, 32, engine_predicted_ms=9.5, actual_ms=12.0) == 9.5  # past the job's list: the engine's
    acts = r.tokens_out(0, 1, "x", T0 + 20)
    assert acts[:3] == [EndSpan(Span.MAIN, attrs={"kairos.chunks_run": 2}), ReleaseSlot(), StartDecode()]
    assert kinds(acts[3:]) == [Publish] and (r.phase, r.prefill_done_ms, r.first_token_ms) == (P.DECODING, T0 + 20,
                                                                                              T0 + 20)
    assert kinds(r.tokens_out(1, 2, "y z", T0 + 25)) == [Publish] and r.tokens == 3  # no second slot release
    acts = r.finished("stop", engine_cached_tokens=8, now_ms=T0 + 30)
    assert kinds(acts) == [EndSpan, Publish, WriteRecord]
    assert published(acts)[0].cached_tokens == 16  # the larger of the engine's report and the prefix hit seen
    assert record(acts).record == DecodeTiming(
        node="decode-0", kind="deflect", received_unix_ms=T0, prefill_start_unix_ms=T0 + 1,
        prefill_done_unix_ms=T0 + 20, first_token_unix_ms=T0 + 20, finished_unix_ms=T0 + 30, completion_tokens=3,
        chunk_predicted_ms=[11.0, 9.5], chunk_actual_ms=[10.5, 12.0], chunk_sizes=[32, 32])


def test_a_deflection_finishing_without_a_token_still_releases_its_slot():
    r = deflect()
    acts = r.finished("stop", 0, T0 + 5)
    assert ReleaseSlot() in acts and EndSpan(Span.MAIN) in acts and r.phase is P.GONE


# -- endings -------------------------------------------------------------------------------------------
def _at(phase_of: str) -> NodeRequest:
    """A request brought to a phase through its transitions."""
    if phase_of == "prefilling":
        return keep()
    if phase_of in ("held", "handed_off"):
        r = keep()
        r.prefill_done(T0 + 1)
        if phase_of == "handed_off":
            r.handed_off("decode-0", T0 + 2, 1.0)
        return r
    if phase_of == "deflected_prefill":
        return deflect()
    if phase_of in ("waiting", "awaiting_kv", "decoding"):
        r = remote()
        if phase_of != "waiting":
            r.allocated(T0 + 1)
        if phase_of == "decoding":
            r.kv_arrived(T0 + 2, 1.0)
        return r
    raise AssertionError(phase_of)


LIVE = ["prefilling", "held", "handed_off", "deflected_prefill", "waiting", "awaiting_kv", "decoding"]


@pytest.mark.parametrize("where", LIVE)
def test_a_failure_in_any_phase_frees_everything_tells_the_client_and_writes_the_record(where):
    r = _at(where)
    assert r.phase == where
    acts = r.failed(ErrorCode.KV_HANDOFF_FAILED, "nobody took it", T0 + 9)
    assert acts[:3] == [FreeEngine(held_only=False), ReleaseSlot(),
                        Publish(ErrorEvent(request_id="r1", status=503, code=ErrorCode.KV_HANDOFF_FAILED,
                                           message="nobody took it", source=f"node_agent:{r.node}",
                                           sent_unix_ms=T0 + 9))]
    assert acts[3:6] == [EndSpan(s, status="kv_handoff_failed") for s in ALL_SPANS]
    rec = record(acts)
    assert (rec.part, type(rec.record), rec.record.error) == (
        ("prefill", PrefillTiming, "kv_handoff_failed") if r.role is RequestRole.PREFILL
        else ("decode", DecodeTiming, "kv_handoff_failed"))
    assert r.phase is P.GONE and r.kv_backlog_ms == 0.0


def test_an_engine_failure_carries_the_engines_status():
    r = _at("decoding")
    err = published(r.failed(ErrorCode.ENGINE_REJECTED_REQUEST, "too long", T0 + 3, status=413))[0]
    assert (err.status, err.code) == (413, ErrorCode.ENGINE_REJECTED_REQUEST)


@pytest.mark.parametrize("where", LIVE)
def test_a_cancel_frees_everything_and_leaves_a_record_unless_the_prefill_record_is_written(where):
    r = _at(where)
    acts = r.cancelled("client_disconnected")
    assert acts[:2] == [FreeEngine(held_only=False), ReleaseSlot()]
    assert [a for a in acts if isinstance(a, EndSpan)] == [EndSpan(s, status="cancelled: client_disconnected")
                                                           for s in ALL_SPANS]
    recs = [a for a in acts if isinstance(a, WriteRecord)]
    if where == "handed_off":  # written at the handoff: it says everything about this node's part
        assert recs == []
    else:
        assert [(w.part, w.record.error) for w in recs] == [
            ("prefill" if r.role is RequestRole.PREFILL else "decode", "cancelled: client_disconnected")]
    assert published(acts) == [] and r.phase is P.GONE


@pytest.mark.parametrize("where", LIVE)
def test_a_drain_fails_what_this_node_owes_an_answer_and_leaves_a_handed_off_kv_to_its_decode_node(where):
    r = _at(where)
    acts = r.shutdown(T0 + 50)
    if where == "handed_off":
        assert acts == [] and r.phase is P.HANDED_OFF
    else:
        (err,) = published(acts)
        assert (err.code, err.status, err.message) == (ErrorCode.NODE_SHUTDOWN, 503, f"node {r.node} is shutting down")
        assert r.phase is P.GONE


# -- refused events ------------------------------------------------------------------------------------
def _gone() -> NodeRequest:
    r = deflect()
    r.tokens_out(0, 1, "a", T0 + 1)
    r.finished("stop", 0, T0 + 2)
    return r


#: (how the request got where it is, the event it may not take there)
REFUSED = [
    ("deflected_prefill", lambda r: r.prefill_done(T0)),  # a deflection has no handoff
    ("held", lambda r: r.prefill_done(T0)),  # twice
    ("prefilling", lambda r: r.tokens_out(0, 1, "a", T0)),  # a prefill node sends no tokens
    ("held", lambda r: r.finished("stop", 0, T0)),
    ("prefilling", lambda r: r.handed_off("decode-0", T0, 1.0)),  # no KV yet
    ("prefilling", lambda r: r.kv_pulled(1.0)),
    ("prefilling", lambda r: r.expire_hold()),
    ("waiting", lambda r: r.tokens_out(0, 1, "a", T0)),  # no blocks, no KV: no token either
    ("waiting", lambda r: r.kv_arrived(T0, 1.0)),
    ("awaiting_kv", lambda r: r.allocated(T0)),  # allocated twice
    ("decoding", lambda r: r.kv_arrived(T0, 1.0)),
    ("decoding", lambda r: r.prefill_done(T0)),
    ("deflected_prefill", lambda r: r.allocated(T0)),
    ("handed_off", lambda r: r.handed_off("decode-1", T0, 1.0)),  # a second decode node
    ("gone", lambda r: r.finished("stop", 0, T0)),  # anything after the end
    ("gone", lambda r: r.tokens_out(5, 1, "late", T0)),
    ("gone", lambda r: r.failed(ErrorCode.ENGINE_ERROR, "late", T0)),
    ("gone", lambda r: r.cancelled("late")),
    ("gone", lambda r: r.handed_off("decode-0", T0, 1.0)),  # gone without the KV pulled: a cancel, not the race
]


@pytest.mark.parametrize("where, event", REFUSED, ids=[f"{i}-{w}" for i, (w, _) in enumerate(REFUSED)])
def test_an_event_the_phase_does_not_allow_is_refused_and_changes_nothing(where, event):
    r = _gone() if where == "gone" else _at(where)
    before = copy.deepcopy(vars(r))
    acts = event(r)
    assert len(acts) == 1 and isinstance(acts[0], Ignored) and f"in phase {r.phase.value}" in acts[0].reason
    assert vars(r) == before


def test_every_phase_but_the_engines_internal_ones_is_reached_and_every_role_ends_gone():
    seen = {_at(w).phase for w in LIVE} | {_gone().phase}
    assert seen == set(P) - {P.READY}  # READY: a decode waiting for a running slot inside the engine model
