"""Job acceptance's execution claims (kairos/services/node_agent/acceptance.py) against an in-memory
requests bucket that behaves as nats-py's KeyValue does (tests/unit/fake_kv.py), and the node
agent's answer to each claim outcome (kairos/services/node_agent/agent.py ``_on_job``): at most one
execution per bus request id — a node runs a request only when it won the claim (or holds it from
this incarnation), never when the bus cannot answer or an earlier incarnation held it."""

from __future__ import annotations

import io
import json
import sys

import msgspec
import nats.errors
import nats.js.errors
import pytest

from kairos.services.node_agent import acceptance
from kairos.services.node_agent.acceptance import Claims
from kairos.services.node_agent.agent import NodeAgent
from kairos.services.node_agent.config import AgentConfig
from kairos.contracts import subjects as S
from kairos.runtime import telemetry
from kairos.contracts.events import ErrorEvent, OutEvent
from kairos.contracts.wire import Claim, decode, encode, InferenceRequest, Job, JobAck, now_ms
from tests.unit.fake_kv import FakeKV

NOW = 1_700_000_000_000.0  #: the patched wall clock of every claim made here, ms
EPOCH = NOW - 60_000.0  #: this agent's incarnation began a minute before


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    monkeypatch.setattr(acceptance, "now_ms", lambda: NOW)


def job(rid: str = "req-1", kind: str = "keep", node: str = "prefill-0",
        candidates: tuple[str, ...] = ("decode-1", "decode-0"), dispatcher: str = "d-a", attempt: int = 2) -> Job:
    req = InferenceRequest(request_id=rid, model="m", prompt_tokens=64, max_tokens=3,
                           created_unix_ms=now_ms(), deadline_unix_ms=now_ms() + 60_000)
    return Job(kind=kind, request=req, node=node, decode_candidates=list(candidates), dispatcher_id=dispatcher,
               attempt=attempt)


def held(kv: FakeKV, rid: str, claim: Claim) -> int:
    """Another writer's claim of ``rid`` stored in ``kv``; returns its revision."""
    return kv.put_raw(S.claim_key(rid), encode(claim))


# -- claim ---------------------------------------------------------------------------------------
async def test_a_free_request_is_won_with_a_claim_naming_this_node_and_the_job():
    kv = FakeKV()
    kv.put_raw("claim.other", b"{}")  # revision 1: the bucket's sequence is shared by every key
    res = await Claims(kv, "prefill-0", EPOCH).claim(job())
    want = Claim(node="prefill-0", kind="keep", decode_node="decode-1", dispatcher_id="d-a", attempt=2,
                 claimed_unix_ms=NOW)  # decode_node: the job's first decode candidate
    assert (res.outcome, res.claim, res.revisions, res.error) == ("won", want, (2,), "")  # 2: the next sequence
    assert decode(kv.value(S.claim_key("req-1")), Claim) == want  # stored, under the request's digest key
    assert kv.calls == [("create", S.claim_key("req-1"))]  # one atomic create, nothing read


async def test_a_deflect_job_without_decode_candidates_names_this_node_as_its_decode_node():
    res = await Claims(FakeKV(), "decode-3", EPOCH).claim(job(kind="deflect", node="decode-3", candidates=()))
    assert res.outcome == "won" and res.claim is not None
    assert (res.claim.node, res.claim.kind, res.claim.decode_node) == ("decode-3", "deflect", "decode-3")


async def test_a_second_node_finds_the_first_nodes_claim_and_does_not_overwrite_it():
    kv = FakeKV()
    first = await Claims(kv, "prefill-0", EPOCH).claim(job())
    second = await Claims(kv, "prefill-1", EPOCH).claim(job(node="prefill-1", dispatcher="d-b", attempt=3))
    assert second.outcome == "claimed" and second.claim == first.claim and first.revisions == (1,)
    assert second.revisions is None  # nothing of it to release
    assert decode(kv.value(S.claim_key("req-1")), Claim).node == "prefill-0"


@pytest.mark.parametrize(("claimed_unix_ms", "outcome"), [
    (EPOCH, "mine"),         # made at this incarnation's first ms: this incarnation's (>= epoch)
    (EPOCH + 1.0, "mine"),
    (EPOCH - 1.0, "claimed"),  # one ms before this agent started: an earlier incarnation, died with it
    (0.0, "claimed"),
])
async def test_this_nodes_claim_is_honoured_only_when_made_by_this_incarnation(claimed_unix_ms, outcome):
    kv = FakeKV()
    own = Claim(node="prefill-0", kind="keep", decode_node="decode-0", dispatcher_id="d-a",
                claimed_unix_ms=claimed_unix_ms)
    rev = held(kv, "req-1", own)
    res = await Claims(kv, "prefill-0", EPOCH).claim(job())
    assert (res.outcome, res.claim, res.revisions) == (outcome, own, (rev,) if outcome == "mine" else None)
    assert decode(kv.value(S.claim_key("req-1")), Claim) == own  # never replaced


async def test_another_nodes_claim_made_in_this_incarnation_is_still_not_mine():
    kv = FakeKV()
    other = Claim(node="prefill-1", kind="keep", claimed_unix_ms=NOW)
    held(kv, "req-1", other)
    res = await Claims(kv, "prefill-0", EPOCH).claim(job())
    assert res.outcome == "claimed" and res.claim == other


async def test_a_tombstone_is_withdrawn_even_for_the_node_it_would_otherwise_be_mine():
    kv = FakeKV()
    # a tombstone names no node; even one naming this node, made in this incarnation, is withdrawn
    for i, node in enumerate(("", "prefill-0")):
        tomb = Claim(node=node, kind="keep", withdrawn="enqueue_failed", claimed_unix_ms=NOW)
        rev = held(kv, f"req-{i}", tomb)
        res = await Claims(kv, "prefill-0", EPOCH).claim(job(rid=f"req-{i}"))
        assert (res.outcome, res.claim, res.revisions) == ("withdrawn", tomb, None)
        assert rev == kv.entries[S.claim_key(f"req-{i}")][1]  # the tombstone stays


BUS_DOWN = [nats.errors.TimeoutError(), nats.errors.NoRespondersError(), nats.errors.ConnectionClosedError(),
            nats.js.errors.ServiceUnavailableError()]


@pytest.mark.parametrize("exc", BUS_DOWN, ids=lambda e: type(e).__name__)
async def test_a_create_the_bus_does_not_answer_fails_and_claims_nothing(exc):
    kv = FakeKV()
    kv.faults["create"].append(exc)
    res = await Claims(kv, "prefill-0", EPOCH).claim(job())
    assert (res.outcome, res.claim, res.revisions, res.error) == ("failed", None, None, repr(exc))
    # a timeout may hide a stored create: the key is read to tell; any other error stored nothing
    read = [("get", S.claim_key("req-1"))] if isinstance(exc, nats.errors.TimeoutError) else []
    assert kv.calls == [("create", S.claim_key("req-1")), *read]
    assert kv.value(S.claim_key("req-1")) is None


async def test_a_create_stored_whose_answer_was_lost_is_won_when_the_read_finds_it():
    kv = FakeKV()
    want = Claim(node="prefill-0", kind="keep", decode_node="decode-1", dispatcher_id="d-a", attempt=2,
                 claimed_unix_ms=NOW)

    def stored_then_lost():
        kv.put_raw(S.claim_key("req-1"), encode(want))
        raise nats.errors.TimeoutError
    kv.faults["create"].append(stored_then_lost)
    res = await Claims(kv, "prefill-0", EPOCH).claim(job())
    assert (res.outcome, res.claim, res.revisions) == ("won", want, (1,))  # its revision known: releasable


@pytest.mark.parametrize("exc", [nats.errors.TimeoutError(), nats.js.errors.KeyNotFoundError()],
                         ids=["read_timeout", "deleted_meanwhile"])
async def test_a_held_claim_that_cannot_be_read_fails(exc):
    # the key existed at the create (someone holds it) but the read gets no claim: the timeout, or
    # the holder released it (compare-and-delete) in between — the dispatcher retries either way
    kv = FakeKV()
    held(kv, "req-1", Claim(node="prefill-1", kind="keep", claimed_unix_ms=NOW))
    kv.faults["get"].append(exc)
    res = await Claims(kv, "prefill-0", EPOCH).claim(job())
    assert (res.outcome, res.claim, res.revisions, res.error) == ("failed", None, None, repr(exc))
    assert kv.calls == [("create", S.claim_key("req-1")), ("get", S.claim_key("req-1"))]


async def test_a_held_value_that_is_no_claim_or_empty_fails():
    kv = FakeKV()
    kv.put_raw(S.claim_key("garbled"), b'{"node": 7}')
    kv.put_raw(S.claim_key("empty"), b"")
    bad = await Claims(kv, "prefill-0", EPOCH).claim(job(rid="garbled"))
    assert bad.outcome == "failed" and bad.claim is None and bad.error.startswith("WireError('bad Claim message")
    empty = await Claims(kv, "prefill-0", EPOCH).claim(job(rid="empty"))
    assert (empty.outcome, empty.claim, empty.revisions, empty.error) == ("failed", None, None, "empty claim")


# -- release and holder ----------------------------------------------------------------------------
async def test_release_deletes_the_won_claim_so_another_node_can_win_it():
    kv = FakeKV()
    mine = await Claims(kv, "prefill-0", EPOCH).claim(job())
    await Claims(kv, "prefill-0", EPOCH).release("req-1", mine.revisions)
    assert kv.value(S.claim_key("req-1")) is None
    other = await Claims(kv, "prefill-1", EPOCH).claim(job(node="prefill-1"))
    assert other.outcome == "won" and other.claim.node == "prefill-1"
    assert other.revisions == (3,)  # 1: the claim, 2: its delete marker, 3: the new claim


async def test_release_is_compare_and_delete_and_never_raises():
    kv = FakeKV()
    mine = await Claims(kv, "prefill-0", EPOCH).claim(job())  # revision 1
    await kv.delete(S.claim_key("req-1"))  # released meanwhile (revision 2) ...
    theirs = await Claims(kv, "prefill-1", EPOCH).claim(job(node="prefill-1"))  # ... and won again (3)
    await Claims(kv, "prefill-0", EPOCH).release("req-1", mine.revisions)  # stale revision 1: refused, swallowed
    assert decode(kv.value(S.claim_key("req-1")), Claim) == theirs.claim
    kv.faults["delete"].append(nats.errors.TimeoutError())
    await Claims(kv, "prefill-1", EPOCH).release("req-1", theirs.revisions)  # bus down: swallowed too
    assert kv.calls[-1] == ("delete", S.claim_key("req-1"))


async def test_holder_names_the_claim_or_none():
    kv = FakeKV()
    c = Claim(node="prefill-1", kind="keep", claimed_unix_ms=NOW)
    held(kv, "req-1", c)
    kv.put_raw(S.claim_key("empty"), b"")
    kv.put_raw(S.claim_key("garbled"), b'{"node": 7}')
    claims = Claims(kv, "decode-0", EPOCH)
    assert await claims.holder("req-1") == c
    assert await claims.holder("never-claimed") is None
    assert await claims.holder("empty") is None
    assert await claims.holder("garbled") is None
    kv.faults["get"].append(nats.errors.TimeoutError())
    assert await claims.holder("req-1") is None


# -- the node agent acts on the claim --------------------------------------------------------------
class Msg:
    """A job request as nats-py delivers it to the agent's subscription (a reply subject, no headers)."""

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data, self.reply, self.headers = subject, data, "_INBOX.test", None
        self.answers: list[JobAck] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(decode(data, JobAck))


class Bus:
    """The agent's connection, as far as an out event goes: what it published, decoded."""

    def __init__(self) -> None:
        self.published: list[tuple[str, OutEvent]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append((subject, decode(payload, OutEvent)))


@pytest.fixture
def logs():
    """The JSON log lines written while the test runs (configured before the agent binds its logger;
    afterwards logging goes to this session's stderr again, not to a stream a test session closed)."""
    buf = io.StringIO()
    telemetry.configure_logging("info", "json", stream=buf)
    yield lambda: [json.loads(x) for x in buf.getvalue().splitlines()]
    telemetry.configure_logging("info", "json", stream=sys.stderr)


@pytest.fixture
def agent(logs):
    a = NodeAgent(AgentConfig(node_id="prefill-0", role="prefill"))  # constructed, never started: no bus
    a.nc = Bus()
    yield a
    a.tel.shutdown()


async def submit(agent: NodeAgent, j: Job) -> JobAck:
    msg = Msg(S.jobs_subject(agent.cfg.node_id), encode(j))
    await agent._on_job(msg)
    assert len(msg.answers) == 1
    return msg.answers[0]


async def test_the_agent_runs_a_job_whose_claim_it_won(agent):
    kv = FakeKV()
    agent.claims = Claims(kv, "prefill-0", EPOCH)
    ack = await submit(agent, job("won-here"))
    assert ack.accepted and ack.reason == "" and ack.node == "prefill-0"
    assert "won-here" in agent.reqs and agent.backend.phase("won-here") is not None  # the engine has it
    assert decode(kv.value(S.claim_key("won-here")), Claim).node == "prefill-0"


@pytest.mark.parametrize("exc", BUS_DOWN[:2], ids=lambda e: type(e).__name__)
async def test_the_agent_refuses_and_never_runs_a_job_whose_claim_failed(agent, logs, exc):
    kv = FakeKV()
    kv.faults["create"].append(exc)
    agent.claims = Claims(kv, "prefill-0", EPOCH)
    ack = await submit(agent, job("bus-down"))
    assert not ack.accepted and ack.reason == "claim_failed"
    assert "bus-down" not in agent.reqs and agent.backend.phase("bus-down") is None  # the engine never got it
    said = [(x["event"], x.get("error"), x.get("reason")) for x in logs() if x.get("request_id") == "bus-down"]
    assert said == [("claim_failed", repr(exc), None), ("job_refused", None, "claim_failed")]
    # the next try, the bus answering, finds no claim stored and runs it (here, once)
    again = await submit(agent, job("bus-down", attempt=3))
    assert again.accepted and again.reason == "" and "bus-down" in agent.reqs


async def test_the_agent_refuses_a_job_before_its_requests_bucket_is_open(agent):
    assert agent.claims is None
    ack = await submit(agent, job("too-early"))
    assert not ack.accepted and ack.reason == "claim_failed" and "too-early" not in agent.reqs
    assert agent.backend.phase("too-early") is None


async def test_the_agent_refuses_a_job_its_earlier_incarnation_claimed_and_says_the_request_is_lost(agent):
    kv = FakeKV()
    before = Claim(node="prefill-0", kind="keep", decode_node="decode-0", claimed_unix_ms=EPOCH - 1.0)
    held(kv, "lost-in-restart", before)
    agent.claims = Claims(kv, "prefill-0", EPOCH)
    ack = await submit(agent, job("lost-in-restart"))
    assert not ack.accepted and ack.reason == "claimed" and ack.claim == before
    assert "lost-in-restart" not in agent.reqs and agent.backend.phase("lost-in-restart") is None
    [(subject, ev)] = agent.nc.published
    assert subject == S.out_subject("lost-in-restart", "agent-prefill-0")
    assert isinstance(ev, ErrorEvent) and (ev.status, ev.code) == (503, "node_lost")


async def test_the_agent_answers_duplicate_for_a_job_this_incarnation_claimed_and_does_not_run_it_again(agent):
    kv = FakeKV()
    ours = Claim(node="prefill-0", kind="keep", decode_node="decode-0", claimed_unix_ms=EPOCH + 1.0)
    held(kv, "ran-here", ours)  # claimed (and run) by this incarnation; the request has left the node since
    agent.claims = Claims(kv, "prefill-0", EPOCH)
    ack = await submit(agent, job("ran-here", dispatcher="d-b", attempt=3))  # redelivered via another dispatcher
    assert ack.accepted and ack.reason == "duplicate"
    assert "ran-here" not in agent.reqs and agent.backend.phase("ran-here") is None
    assert agent.nc.published == []


async def claim_answer_lost(agent, rid: str) -> tuple[FakeKV, JobAck]:
    """A job for ``rid`` whose claim create is stored but its answer lost, and the read that would
    tell times out too: the node answers ``claim_failed`` and holds a claim it does not know of."""
    kv = FakeKV()

    def stored_then_lost():
        kv.put_raw(S.claim_key(rid), encode(Claim(node="prefill-0", kind="keep", decode_node="decode-1",
                                                  claimed_unix_ms=NOW)))
        raise nats.errors.TimeoutError

    kv.faults["create"].append(stored_then_lost)
    kv.faults["get"].append(nats.errors.TimeoutError())
    agent.claims = Claims(kv, "prefill-0", EPOCH)
    return kv, await submit(agent, job(rid))


async def test_a_claim_stored_though_its_answer_was_lost_is_run_by_the_next_try_here(agent):
    _, first = await claim_answer_lost(agent, "answer-lost")
    assert not first.accepted and first.reason == "claim_failed" and "answer-lost" not in agent.reqs
    again = await submit(agent, job("answer-lost", attempt=3))  # finds this node's claim, never started: runs it
    assert again.accepted and again.reason == "" and agent.backend.phase("answer-lost") is not None


async def test_a_job_from_a_dispatcher_counting_other_claim_buckets_is_refused_and_claims_nothing(agent):
    # a node with 3 claim buckets and a dispatcher (so: other nodes) with 1 could both hold a "majority"
    kvs = [FakeKV(S.claims_bucket(i)) for i in range(3)]
    agent.claims = Claims(kvs, "prefill-0", EPOCH)
    ack = await submit(agent, msgspec.structs.replace(job("mismatch"), claim_buckets=1))
    assert not ack.accepted and ack.reason.startswith("lane_mismatch: the dispatcher has 1 claim buckets, this node 3")
    assert all(kv.calls == [] for kv in kvs) and "mismatch" not in agent.reqs
    ok = await submit(agent, msgspec.structs.replace(job("agreed"), claim_buckets=3))
    assert ok.accepted


async def test_a_claim_stored_though_its_answer_was_lost_is_given_up_when_the_node_then_refuses_the_job(agent):
    # the dispatcher sends the job again to the node holding the claim; the node cannot take it now
    # (here: its deadline passed): it gives the claim up, so the request is not left claimed by nobody
    kv, first = await claim_answer_lost(agent, "given-up")
    key = S.claim_key("given-up")
    assert first.reason == "claim_failed" and kv.value(key) is not None  # stored, unknown to the node
    late = job("given-up", attempt=3)
    late = msgspec.structs.replace(late, request=msgspec.structs.replace(late.request, deadline_unix_ms=NOW - 1))
    refused = await submit(agent, late)
    assert not refused.accepted and refused.reason == "deadline_passed"
    assert kv.value(key) is None  # released (compare-and-delete of its own revision)
