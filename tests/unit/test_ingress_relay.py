"""The ingress's relay of a request, driven through real HTTP with a fake bus and a manual clock (no nats-server).

An :class:`~kairos.services.ingress.service.Ingress` is assembled with :class:`FakeBus` (it records
every enqueue, job, cancel and record) and serves HTTP on a free port. The test plays the
dispatchers and the node agents: a dispatcher hands the published attempt's job to the ingress on the
attempt's conversation subject, the ingress sends it and the node accepts it (:meth:`JobRelay.on_notice`,
:meth:`FakeBus.send_job`), and the nodes send out events on the subjects the bus would prove
(``kairos.out.<attempt>.<sender>``, :meth:`Flights.on_out`). Time moves only when a test advances the clock,
and the watchers' checks run when the test calls them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.permissions import DISPATCHER, agent_user
from kairos.contracts.events import DoneEvent, ErrorEvent, TokenEvent
from kairos.contracts.wire import decode, encode, InferenceRequest, JobAck
from kairos.contracts.records import IngressTiming
from kairos.runtime.clock import ManualClock
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.service import Ingress

MODEL = "kairos-emulated"
#: how long a test waits for the ingress to do something it must do at once (a safety net, not a sleep)
WAIT_S = 5.0


@dataclass
class Msg:
    """A NATS message as the ingress's callbacks read it."""

    subject: str
    data: bytes
    headers: dict | None = None
    reply: str = ""


@dataclass
class FakeBus:
    """:class:`kairos.services.ingress.ports.IngressBus` in memory: what the ingress sent, in order."""

    enqueued: asyncio.Queue = field(default_factory=asyncio.Queue)  #: published InferenceRequests
    cancels: list[tuple[str, str]] = field(default_factory=list)  #: (attempt id, reason)
    drains: list[tuple[str, str]] = field(default_factory=list)  #: (node, reason)
    records: dict[str, bytes] = field(default_factory=dict)
    max_payload: int = 1024 * 1024
    jobs: list[tuple[str, bytes]] = field(default_factory=list)  #: (node, job bytes) the ingress sent
    #: node -> what it answers a job (a JobAck's bytes, or an exception to raise); default: accepted
    job_answers: dict[str, Any] = field(default_factory=dict)
    answered: asyncio.Queue = field(default_factory=asyncio.Queue)  #: (reply subject, JobAck) to dispatchers

    def disconnected_since(self) -> float | None:
        return None

    async def enqueue(self, body: bytes, headers: dict[str, str], first_delivery: int = 1, give_up: Any = None) -> int:
        req = decode(body, InferenceRequest)
        assert headers[S.NOTICES_HEADER] == self.notice_subject(req.request_id)
        self.enqueued.put_nowait(req)
        return 1

    def notice_subject(self, attempt_id: str) -> str:
        return f"_INBOX.ingress.test.{attempt_id}"

    async def ping_dispatchers(self) -> str | None:
        return None

    async def send_job(self, node: str, job: bytes, headers: dict[str, str] | None) -> bytes:
        self.jobs.append((node, job))
        assert orjson.loads(job)["request"]["request_id"], job  # the ingress spliced its request in
        answer = self.job_answers.get(node, JobAck(accepted=True, node=node))
        if isinstance(answer, Exception):
            raise answer
        return encode(answer)

    async def respond(self, reply: str, data: bytes) -> None:
        self.answered.put_nowait((reply, decode(data, JobAck)))

    async def subscribe_out(self, attempt_id: str, cb: Any) -> Any:
        raise AssertionError("the ingress of these tests has the one out wildcard subscription")

    async def cancel(self, attempt_id: str, reason: str) -> None:
        self.cancels.append((attempt_id, str(reason)))

    async def drain(self, node: str, reason: str) -> None:
        self.drains.append((node, reason))

    async def read_record(self, key: str, typ: type) -> Any:
        return decode(self.records[key], typ) if key in self.records else None

    async def write_record(self, key: str, data: bytes) -> None:
        self.records[key] = data

    async def published(self) -> InferenceRequest:
        """The next attempt the ingress enqueued."""
        return await asyncio.wait_for(self.enqueued.get(), WAIT_S)


@dataclass
class Stack:
    ing: Ingress
    bus: FakeBus
    clock: ManualClock
    http: aiohttp.ClientSession
    base: str

    async def plan(self, attempt: str, node: str, kind: str = "deflect", epoch: float = 0.0) -> JobAck:
        """A dispatcher hands ``attempt``'s job for ``node`` to the ingress, which sends it (the node
        answers by :attr:`FakeBus.job_answers`, accepted by default, from incarnation ``epoch``);
        returns what the ingress answered the dispatcher. Only the fields the ingress reads are in
        the job (kairos.contracts.wire.JobHead)."""
        self.bus.job_answers.setdefault(node, JobAck(accepted=True, node=node, epoch_unix_ms=epoch))
        job = orjson.dumps({"v": 2, "kind": kind, "request": None, "node": node, "predicted_ttft_ms": 12.5})
        await self.ing.jobs.on_notice(Msg(self.bus.notice_subject(attempt), job, reply=f"_INBOX.dispatcher.{attempt}"))
        reply, ack = await asyncio.wait_for(self.bus.answered.get(), WAIT_S)
        assert reply == f"_INBOX.dispatcher.{attempt}"
        return ack

    async def routed(self, attempt: str, node: str, kind: str = "deflect", epoch: float = 0.0) -> None:
        """A dispatcher's job for ``node`` goes out through the ingress and ``node`` accepts it."""
        ack = await self.plan(attempt, node, kind, epoch)
        assert ack.accepted, ack

    async def out(self, sender: str, ev: Any) -> None:
        """An out event published by NATS user ``sender`` (the subject proves who sent it)."""
        await self.ing.flights.on_out(Msg(S.out_subject(ev.request_id, sender), encode(ev)))

    async def tokens(self, attempt: str, node: str, texts: list[str]) -> None:
        for i, text in enumerate(texts):
            await self.out(agent_user(node), TokenEvent(request_id=attempt, first_index=i, count=1, text=text,
                                                        node=node, sent_unix_ms=self.clock.now_ms()))
        await self.out(agent_user(node), DoneEvent(request_id=attempt, completion_tokens=len(texts), node=node,
                                                   sent_unix_ms=self.clock.now_ms()))

    async def record(self, rid: str) -> IngressTiming:
        """The ingress record of ``rid`` (written in the background when the request ends)."""
        await self.ing.bg.wait_all()
        return decode(self.bus.records[S.record_key(rid, "ingress")], IngressTiming)


@pytest.fixture
async def stack():
    clock = ManualClock()
    ing = Ingress(IngressConfig(port=0, served_model=MODEL, log_level="error"), clock=clock)
    bus = FakeBus()
    ing.assemble(bus)
    await ing.serve_http()
    async with aiohttp.ClientSession() as http:
        yield Stack(ing, bus, clock, http, f"http://127.0.0.1:{ing.port}")
    await ing.close()


def post(st: Stack, **body: Any) -> asyncio.Task:
    """``POST /v1/completions`` in the background (its answer needs the test to play the nodes)."""
    async def go() -> tuple[int, Any, bytes]:
        async with st.http.post(st.base + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], **body}) as r:
            return r.status, r.headers.copy(), await r.read()

    return asyncio.ensure_future(go())


def sse_payloads(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body (JSON decoded, ``[DONE]`` as is)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


async def test_a_stream_of_tokens_then_done_reaches_the_client_as_sse(stack):
    st = stack
    answer = post(st, max_tokens=3, stream=True)
    req = await st.bus.published()
    assert req.prompt_token_ids == [1, 2, 3] and req.max_tokens == 3
    rid = req.request_id
    await st.routed(rid, "decode-0")
    await st.tokens(rid, "decode-0", ["a", "b", "c"])
    status, headers, body = await asyncio.wait_for(answer, WAIT_S)
    assert status == 200 and headers["Content-Type"] == "text/event-stream" and headers["X-Request-Id"] == rid
    events = sse_payloads(body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abc"
    # one chunk per token event, the finish reason on the last (as vLLM's stream: no extra chunk)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert all(c["id"] == rid and c["object"] == "text_completion" for c in chunks)
    assert st.bus.cancels == []  # a completed request is not cancelled
    rec = await st.record(rid)
    assert rec.status == 200 and rec.completion_tokens == 3 and rec.error is None and rec.prompt_tokens == 3


async def test_a_node_lost_before_any_token_resubmits_the_request(stack):
    st = stack
    answer = post(st, max_tokens=2)
    first = await st.bus.published()
    rid = first.request_id
    await st.routed(rid, "decode-0")
    st.clock.advance(st.ing.cfg.liveness_timeout_s + 0.1)  # decode-0 silent: no heartbeat, no token
    st.ing.watch.check()
    again = await st.bus.published()
    assert again.request_id == f"{rid}-r1" and again.prompt_token_ids == first.prompt_token_ids
    assert st.bus.cancels == [(rid, "resubmitted")]  # what the lost attempt holds is freed
    assert st.ing.m.node_lost.labels("resubmitted")._value.get() == 1
    await st.tokens(rid, "decode-0", ["stale"])  # the old attempt's events are dropped
    await st.routed(again.request_id, "decode-1")
    await st.tokens(again.request_id, "decode-1", ["x", "y"])
    status, headers, body = await asyncio.wait_for(answer, WAIT_S)
    got = orjson.loads(body)
    assert status == 200 and got["id"] == rid and got["choices"][0]["text"] == "xy", got
    assert got["usage"]["completion_tokens"] == 2
    rec = await st.record(rid)
    assert rec.resubmitted_as == [f"{rid}-r1"] and rec.status == 200


@pytest.mark.parametrize("code, sender, source", [
    (ErrorCode.NO_AVAILABLE_NODE, DISPATCHER, "dispatcher:dispatcher-0"),
    (ErrorCode.ENGINE_ERROR, agent_user("decode-0"), "node_agent:decode-0"),
], ids=["dispatcher", "node"])
async def test_an_error_event_answers_the_openai_error_with_the_codes_status(stack, code, sender, source):
    st = stack
    answer = post(st, max_tokens=2, stream=True)  # no token yet: a JSON error with a status, not an SSE event
    rid = (await st.bus.published()).request_id
    if sender != DISPATCHER:
        await st.routed(rid, "decode-0")
    await st.out(sender, ErrorEvent(request_id=rid, status=code.status, code=code, message="it failed",
                                    source=source, sent_unix_ms=st.clock.now_ms()))
    status, headers, body = await asyncio.wait_for(answer, WAIT_S)
    err = orjson.loads(body)["error"]
    assert status == code.status and err["code"] == code.value and err["message"] == "it failed", err
    assert err["type"] == ("service_unavailable" if code.status == 503 else "server_error")
    assert headers["X-Request-Id"] == rid and headers.get("Retry-After") == ("1" if code.status == 503 else None)
    assert st.bus.cancels == [(rid, code.value)]  # a node accepting it late must not run it
    rec = await st.record(rid)
    assert rec.status == code.status and rec.error == code.value


async def test_a_client_that_disconnects_gets_its_request_cancelled(stack):
    st = stack

    async def client() -> bytes:
        async with st.http.post(st.base + "/v1/completions",
                                json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5, "stream": True}) as r:
            assert r.status == 200
            return await r.content.readuntil(b"\n\n")  # the first chunk, then the client leaves

    reading = asyncio.ensure_future(client())
    rid = (await st.bus.published()).request_id
    await st.routed(rid, "decode-0")
    await st.out(agent_user("decode-0"), TokenEvent(request_id=rid, first_index=0, count=1, text="a", node="decode-0",
                                                    sent_unix_ms=st.clock.now_ms()))
    first = await asyncio.wait_for(reading, WAIT_S)  # the response is released: its connection is closed
    assert b'"text":"a"' in first
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not st.bus.cancels:  # the server sees the closed connection within a few loop turns
        assert asyncio.get_running_loop().time() < deadline, "the disconnect was never noticed"
        st.ing.watch.check_clients()
        await asyncio.sleep(0.01)
    assert st.bus.cancels == [(rid, "client_disconnected")]
    assert st.ing.m.disconnects.labels("completions", "true")._value.get() == 1
    rec = await st.record(rid)
    assert rec.status == 499 and rec.error == "client_disconnected" and rec.completion_tokens == 1
