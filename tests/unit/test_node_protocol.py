"""The node agent's protocol logic without a nats-server: its parts (kairos/services/node_agent/jobs.py,
kv.py, slots.py, effects.py) built on a :class:`NodeContext` whose connection records what it
publishes and answers requests as the test says and whose clock is manual (kairos/runtime/clock.py: a retry's pause takes no
time). Job acceptance (slots taken before the reservation's await, an engine refusal giving the
slot back, a cancelled request) and the KV handoff on both sides (candidates in order, retries while
the connection settles, the pulled notice, a handoff whose body names another node than its sender)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

import nats.errors
import structlog
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.origin import OriginGuard, forged_counter
from kairos.contracts.permissions import agent_user
from kairos.contracts.records import PrefillTiming
from kairos.contracts.events import ErrorEvent, HandoffEvent, OutEvent
from kairos.contracts.wire import (decode, encode, InferenceRequest, Job, JobAck, KvAck, KvDone, KvHandoff,
                                   Reservation)
from kairos.core.vocabulary import RequestPhase
from kairos.engines.emulated import EmulatedBackend
from kairos.runtime.clock import ManualClock
from kairos.runtime.resources import BackgroundTasks
from kairos.services.node_agent.config import AgentConfig
from kairos.services.node_agent.context import NodeContext
from kairos.services.node_agent.effects import Effects
from kairos.services.node_agent.jobs import Jobs
from kairos.services.node_agent.kv import KvReceiver, KvSender
from kairos.services.node_agent.metrics import AgentMetrics
from kairos.services.node_agent.request import NodeRequest
from kairos.services.node_agent.slots import DeflectionSlots
from tests.factories import tiny_model

MODEL = tiny_model()


@dataclass
class Ack:
    seq: int


class FakeJetStream:
    """``nc.jetstream()`` as far as a reservation's put goes (kairos.runtime.messaging.kv_put_ttl);
    a put waits at ``gate`` (a slow bucket) once a test clears it."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, bytes, int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def publish(self, subject: str, value: bytes, msg_ttl: int, timeout: float) -> Ack:
        await self.gate.wait()
        self.puts.append((subject, value, msg_ttl))
        return Ack(len(self.puts))


class FakeBus:
    """The agent's connection: records publishes; ``answer[subject]`` answers a request there (a
    callable of the request's body returning the reply's body, or an exception to raise); a subject
    nobody answers raises NoRespondersError, as nats-py does."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes, dict | None]] = []
        self.requests: list[str] = []
        self.answer: dict[str, Callable[[bytes], bytes] | BaseException] = {}
        self.js = FakeJetStream()

    async def publish(self, subject: str, payload: bytes, headers: dict | None = None) -> None:
        self.published.append((subject, payload, headers))

    async def request(self, subject: str, payload: bytes, timeout: float, headers: dict | None = None) -> Any:
        self.requests.append(subject)
        a = self.answer.get(subject)
        if a is None:
            raise nats.errors.NoRespondersError
        if isinstance(a, BaseException):
            raise a
        return type("Reply", (), {"data": a(payload)})()

    def jetstream(self) -> FakeJetStream:
        return self.js

    def out(self, rid: str, node: str) -> list[OutEvent]:
        """The out events published for ``rid`` by ``node``, decoded."""
        subject = S.out_subject(rid, agent_user(node))
        return [decode(p, OutEvent) for s, p, _ in self.published if s == subject]


class Msg:
    """A message as nats-py hands it to a subscription callback."""

    def __init__(self, subject: str, data: bytes, reply: str = "_INBOX.t") -> None:
        self.subject, self.data, self.reply, self.headers = subject, data, reply, None
        self.answers: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(data)


def context(node: str, role: str, backend: Any = None, **cfg: Any) -> NodeContext:
    reg = CollectorRegistry()
    log = structlog.get_logger("test").bind(node=node)
    return NodeContext(cfg=AgentConfig(node_id=node, role=role, metrics_port=-1, **cfg), model=MODEL,
                       backend=backend or EmulatedBackend(role, MODEL), log=log, tracer=trace.get_tracer("test"),
                       metrics=AgentMetrics(reg, node), origin=OriginGuard(forged_counter("agent", reg), log),
                       tasks=BackgroundTasks(log), clock=ManualClock(now_ms=1e12), nc=FakeBus())


@dataclass
class Node:
    ctx: NodeContext
    slots: DeflectionSlots
    effects: Effects
    jobs: Jobs
    kv_out: KvSender
    kv_in: KvReceiver

    @property
    def bus(self) -> FakeBus:
        return self.ctx.nc


def node(name: str, role: str, backend: Any = None, **cfg: Any) -> Node:
    """The agent's parts wired as NodeAgent wires them, on a fake context."""
    ctx = context(name, role, backend, **cfg)
    slots = DeflectionSlots(ctx)
    parts: dict[str, Any] = {}
    effects = Effects(ctx, slots, hand_off=lambda r: parts["out"].start(r), pull=lambda r: parts["in"].start_pull(r))
    parts["out"], parts["in"] = KvSender(ctx, effects), KvReceiver(ctx, effects)
    return Node(ctx, slots, effects, Jobs(ctx, slots, effects), parts["out"], parts["in"])


def request(rid: str, prompt: int = 40, out: int = 3) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=out, created_unix_ms=0.0,
                            deadline_unix_ms=1e15)


def deflect_job(rid: str, node_id: str = "decode-0") -> Job:
    return Job(kind="deflect", request=request(rid), node=node_id, chunk_schedule=[16], dispatcher_id="d-a",
               reservation_ttl_s=10)


def keep_job(rid: str, candidates: tuple[str, ...] = ("decode-0", "decode-1", "decode-2")) -> Job:
    return Job(kind="keep", request=request(rid), node="prefill-0", decode_candidates=list(candidates),
               dispatcher_id="d-a")


# -- jobs ----------------------------------------------------------------------------------------------
async def test_a_deflect_job_holds_its_slot_across_the_reservations_wait_so_a_second_one_is_refused():
    n = node("decode-0", "decode")
    n.bus.js.gate.clear()  # the reservation's put waits
    first = asyncio.create_task(n.jobs.handle(deflect_job("a")))
    while not n.slots.held:  # the first job runs up to the put, its slot taken
        await asyncio.sleep(0)
    assert n.slots.held == {"a": S.reservation_key("decode-0", 0)}
    second = await n.jobs.handle(deflect_job("b"))
    assert (second.accepted, second.reason, n.slots.overlaps) == (False, "deflection_in_flight", 1)
    n.bus.js.gate.set()
    ack = await first
    assert ack.accepted and n.ctx.reqs["a"].phase is RequestPhase.DEFLECTED_PREFILL
    # the reservation went out with a TTL and its revision is in the answer (the dispatcher applies it)
    (subject, body, ttl), = n.bus.js.puts
    assert subject == f"$KV.{S.RESERVATION_BUCKET}.{S.reservation_key('decode-0', 0)}" and ttl == 10
    assert decode(body, Reservation).request_id == "a" and ack.reservation_revision == 1
    assert n.slots.max_concurrent == 1


async def test_an_engine_refusal_takes_no_slot_and_stores_nothing():
    class Refusing(EmulatedBackend):
        def add_deflected(self, req, chunk_schedule, decision_batch_size=0):
            raise ValueError("no room")

    n = node("decode-0", "decode", backend=Refusing("decode", MODEL))
    ack = await n.jobs.handle(deflect_job("a"))
    assert (ack.accepted, ack.reason) == (False, "engine_refused: no room")
    assert n.slots.held == {} and "a" not in n.ctx.reqs and n.bus.js.puts == []


async def test_a_job_for_a_cancelled_request_is_refused_and_the_subscription_answers_once():
    n = node("prefill-0", "prefill")
    n.ctx.cancelled.add("late")
    msg = Msg(S.jobs_subject("prefill-0"), encode(keep_job("late")))
    await n.jobs.on_job(msg)
    (answer,) = msg.answers
    assert decode(answer, JobAck).reason == "cancelled" and n.jobs.received == ["late"]
    foreign = Msg("kairos.jobs.other", encode(keep_job("x")))  # not this node's subject: refused as forged
    await n.jobs.on_job(foreign)
    assert foreign.answers == [] and n.jobs.received == ["late"]


async def test_a_cancel_that_comes_while_the_job_waits_for_the_engine_probe_keeps_it_off_the_engine():
    """The agent probes an engine whose state stream is late before it answers a job (up to 0.5 s);
    the request's cancel can come meanwhile (the helper's finding, issue 34): the job is refused
    ``cancelled`` and the engine never gets it."""
    class Probing(EmulatedBackend):
        gate = asyncio.Event()

        async def confirm_available(self, timeout_s: float) -> bool:
            await self.gate.wait()
            return True

    backend = Probing("prefill", MODEL)
    backend.available = False
    n = node("prefill-0", "prefill", backend=backend)
    job = asyncio.create_task(n.jobs.handle(keep_job("probed")))
    while not n.jobs.received:  # the job is in, waiting for the probe
        await asyncio.sleep(0)
    await n.effects.cancel("probed", "client_disconnected")
    Probing.gate.set()
    ack = await job
    assert (ack.accepted, ack.reason) == (False, "cancelled")
    assert "probed" not in n.ctx.reqs and backend.phase("probed") is None


# -- the KV handoff, prefill side ------------------------------------------------------------------
def kv_ack(node_id: str, accepted: bool = True, reason: str = "") -> Callable[[bytes], bytes]:
    return lambda _body: encode(KvAck(accepted=accepted, node=node_id, reason=reason))


def held_request(n: Node, rid: str, candidates: tuple[str, ...] = ("decode-0", "decode-1", "decode-2")) -> NodeRequest:
    """A keep-path request whose prefill is done on ``n`` (its engine holds the KV)."""
    n.ctx.backend.add_prefill(request(rid))
    r = NodeRequest.for_job(keep_job(rid, candidates), "prefill-0", n.ctx.clock.now_ms())
    n.ctx.reqs[rid] = r
    r.prefill_done(n.ctx.clock.now_ms())
    return r


def kv_subject(cand: str) -> str:
    return S.kv_subject(cand, agent_user("prefill-0"))


async def test_the_kv_goes_to_the_first_candidate_that_accepts_and_the_client_is_told_which():
    n = node("prefill-0", "prefill")
    r = held_request(n, "r1")
    n.bus.answer[kv_subject("decode-0")] = nats.errors.TimeoutError()
    n.bus.answer[kv_subject("decode-1")] = kv_ack("decode-1", accepted=False, reason="draining")
    n.bus.answer[kv_subject("decode-2")] = kv_ack("decode-2")
    await n.kv_out.hand_off(r)
    assert n.bus.requests == [kv_subject("decode-0"), kv_subject("decode-1"), kv_subject("decode-2")]
    (ev,) = n.bus.out("r1", "prefill-0")
    assert isinstance(ev, HandoffEvent) and ev.decode_node == "decode-2"
    assert r.phase is RequestPhase.HANDED_OFF and r.kv_backlog_ms == n.ctx.backend.kv_transfer_ms(40) > 0
    await n.ctx.tasks.wait_all()  # the prefill record's write
    (rec,) = [p for s, p, _ in n.bus.published if s == f"$KV.{S.REQUESTS_BUCKET}.{S.record_key('r1', 'prefill', 'prefill-0')}"]
    assert decode(rec, PrefillTiming).handoff_node == "decode-2"


async def test_a_kv_nobody_takes_fails_the_request_and_frees_the_blocks():
    n = node("prefill-0", "prefill")
    r = held_request(n, "r1", ("decode-0",))
    n.ctx.backend.engine.plan_step()  # admitted: the prompt's blocks are reserved
    await n.kv_out.hand_off(r)
    (err,) = n.bus.out("r1", "prefill-0")
    assert isinstance(err, ErrorEvent) and (err.code, err.status) == (ErrorCode.KV_HANDOFF_FAILED, 503)
    assert "decode-0" in err.message and "no_responders" in err.message
    assert "r1" not in n.ctx.reqs and n.ctx.backend.phase("r1") is None


class Settling:
    """A bus watch right after a reconnect: the decode agents may not have re-subscribed yet."""

    def settling(self, window_s: float) -> bool:
        return True


async def test_after_a_reconnect_the_handoff_is_offered_again_until_a_decode_agent_is_back():
    n = node("prefill-0", "prefill")
    n.ctx.bus = Settling()
    r = held_request(n, "r1", ("decode-0",))
    clock = n.ctx.clock

    async def back_after_two_passes(seconds: float) -> None:  # the manual clock's sleep, and the agent resubscribing
        await ManualClock.sleep(clock, seconds)
        if len(clock.slept) == 2:
            n.bus.answer[kv_subject("decode-0")] = kv_ack("decode-0")
    clock.sleep = back_after_two_passes
    await n.kv_out.hand_off(r)
    assert n.bus.requests == [kv_subject("decode-0")] * 3 and clock.slept == [0.2, 0.2]
    assert r.phase is RequestPhase.HANDED_OFF


async def test_the_kv_is_freed_by_the_pulled_notice_of_a_candidate_only():
    n = node("prefill-0", "prefill")
    r = held_request(n, "r1", ("decode-0",))
    n.ctx.backend.engine.plan_step()
    while n.ctx.backend.phase("r1") != RequestPhase.HELD:  # the engine computes the prompt
        n.ctx.backend.engine.commit_step(n.ctx.backend.engine.plan_step())
    notice = encode(KvDone(request_id="r1", decode_node="decode-1", ok=True, transfer_ms=3.0))
    await n.kv_out.on_kvdone(Msg(S.kvdone_subject("prefill-0", agent_user("decode-1")), notice, reply=""))
    assert "r1" in n.ctx.reqs and n.ctx.backend.phase("r1") == RequestPhase.HELD  # not a node the KV was offered to
    notice = encode(KvDone(request_id="r1", decode_node="decode-0", ok=True, transfer_ms=3.0))
    await n.kv_out.on_kvdone(Msg(S.kvdone_subject("prefill-0", agent_user("decode-0")), notice, reply=""))
    assert "r1" not in n.ctx.reqs and n.ctx.backend.phase("r1") is None and r.pulled


# -- the KV handoff, decode side -------------------------------------------------------------------
def decode_node() -> Node:
    return node("decode-0", "decode")


def handoff_msg(src: str, rid: str = "r1") -> Msg:
    h = KvHandoff(request=request(rid), src_node=src, kv_tokens=40, prefill_done_unix_ms=0.0)
    return Msg(S.kv_subject("decode-0", agent_user(src)), encode(h))


async def test_a_handoff_is_taken_only_from_the_node_it_names_and_its_kv_pulled_and_confirmed():
    n = decode_node()
    h = KvHandoff(request=request("r1"), src_node="prefill-0", kv_tokens=40, prefill_done_unix_ms=0.0)
    impostor = Msg(S.kv_subject("decode-0", agent_user("prefill-1")), encode(h))  # prefill-1 naming prefill-0
    await n.kv_in.on_kv(impostor)
    assert decode(impostor.answers[0], KvAck).reason == "forged" and "r1" not in n.ctx.reqs
    msg = handoff_msg("prefill-0")
    await n.kv_in.on_kv(msg)
    assert decode(msg.answers[0], KvAck).accepted
    r = n.ctx.reqs["r1"]
    assert r.phase is RequestPhase.AWAITING_KV  # the engine had blocks at once: the pull started
    await n.ctx.tasks.wait_all()
    assert r.phase is RequestPhase.DECODING and n.ctx.backend.phase("r1") == RequestPhase.DECODING
    (done,) = [decode(p, KvDone) for s, p, _ in n.bus.published if s == S.kvdone_subject("prefill-0", agent_user("decode-0"))]
    assert done.ok and done.request_id == "r1"


async def test_a_cancel_that_overtakes_its_job_or_handoff_is_remembered_and_the_late_one_refused():
    """Issue 33: the ingress moved a request (a migration, a re-submission) and cancelled the old
    attempt; the cancel reaches a node before that attempt's job or KV handoff (another subscription,
    another task). The late job and the late handoff are refused ``cancelled``: nothing runs for nobody."""
    n = decode_node()
    await n.effects.cancel("r1", "migrated")  # unknown here yet
    await n.effects.cancel("d1", "migrated")
    late = handoff_msg("prefill-0")
    await n.kv_in.on_kv(late)
    assert decode(late.answers[0], KvAck).reason == "cancelled" and "r1" not in n.ctx.reqs
    ack = await n.jobs.handle(deflect_job("d1"))
    assert (ack.accepted, ack.reason) == (False, "cancelled") and "d1" not in n.ctx.reqs
    assert n.ctx.backend.phase("r1") is None and n.ctx.backend.phase("d1") is None


async def test_an_offer_that_timed_out_is_revoked_and_the_late_taker_gives_the_kv_up():
    """Fencing (issue 33): decode-0 was paused when the KV was offered (no answer in time), decode-1
    took it. decode-0 gets a revocation after the offer; reading both when it resumes, it takes the
    offer, then drops it unstarted (no token for nobody), and its pulled notice does not free the
    KV decode-1 is pulling."""
    pre = node("prefill-0", "prefill")
    r = held_request(pre, "r1", ("decode-0", "decode-1"))
    pre.bus.answer[kv_subject("decode-0")] = nats.errors.TimeoutError()
    pre.bus.answer[kv_subject("decode-1")] = kv_ack("decode-1")
    await pre.kv_out.hand_off(r)
    sent = [(s, decode(p, KvHandoff)) for s, p, _ in pre.bus.published if s.startswith("kairos.kv.")]
    assert [(s, h.revoke) for s, h in sent] == [(kv_subject("decode-0"), True)]  # decode-1 is not revoked
    # decode-0 resumes: the stale offer first, then the revocation (same sender, same order)
    dec = decode_node()
    stale = handoff_msg("prefill-0")
    await dec.kv_in.on_kv(stale)
    assert decode(stale.answers[0], KvAck).accepted and "r1" in dec.ctx.reqs
    revocation = Msg(kv_subject("decode-0"), encode(sent[0][1]), reply="")
    await dec.kv_in.on_kv(revocation)
    await dec.ctx.tasks.wait_all()
    assert revocation.answers == [] and "r1" not in dec.ctx.reqs and dec.ctx.backend.phase("r1") is None
    assert not [s for s, _, _ in dec.bus.published if s.startswith("kairos.out.")]  # nothing sent to the client
    again = handoff_msg("prefill-0")  # a later copy of the offer
    await dec.kv_in.on_kv(again)
    assert decode(again.answers[0], KvAck).reason == "cancelled"
    # its pulled notice (ok False: aborted) does not free what decode-1 pulls
    notice = encode(KvDone(request_id="r1", decode_node="decode-0", ok=False, transfer_ms=0.0))
    await pre.kv_out.on_kvdone(Msg(S.kvdone_subject("prefill-0", agent_user("decode-0")), notice, reply=""))
    assert r.phase is RequestPhase.HANDED_OFF and "r1" in pre.ctx.reqs
    forged = Msg(S.kv_subject("decode-0", agent_user("prefill-1")), encode(sent[0][1]), reply="")
    await dec.kv_in.on_kv(forged)  # a revocation must come from the node it names
    assert dec.ctx.origin.counter.labels("kv_handoff")._value.get() == 1
