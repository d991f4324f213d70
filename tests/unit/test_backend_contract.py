"""The engine-backend contract (kairos/engines/base.py), the same checks on every backend of
:data:`kairos.engines.BACKENDS` (a new backend is done when it passes them):

* built by the registry from an AgentConfig (``EngineBackend.from_config``);
* keep path, prefill node: the prompt is computed, ``on_prefill_done`` once, the KV held (phase
  ``held``) until ``release``; no token;
* keep path, decode node, with the prefill backend's ``handoff_params``: allocated (``take_allocated``
  or ``on_allocated``, once), ``pull_kv`` returns, ``kv_arrived``, tokens in order from 0, one finish;
* deflect path: a step record names the deflected chunk (χ of the schedule) before the first token,
  tokens in order, one finish; steps reported in order;
* the state snapshot: B ≥ 1 and K ≥ the prompt while the request decodes, B back to 0 after;
* a stop token id ends the request: its token the last, with ``finish_reason`` ``stop`` and the id as
  ``stop_reason`` on that token and on the finish (vLLM's ``stop_reason``);
* abort of a request in flight: True, the phase gone, nothing of it reported after; unknown: False;
* a duplicate id is refused with a ValueError.

The emulated backend runs its engine model in real time (a fast latency model). The vLLM backend
runs against a stand-in vLLM server (tests/unit/test_vllm_backend_http.py's ``StandIn``: a real
aiohttp server answering as vLLM 0.32.0 does) and a stand-in of the plugin's engine-state stream (a
ZMQ publisher): before each token it "runs" a step and publishes it, and waits until the backend has
read it — as the plugin publishes right after each step — so both backends are checked the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from kairos.contracts.wire import InferenceRequest, SamplingParams
from kairos.core.vocabulary import RequestPhase
from kairos.engines import BACKENDS, backend_class, make_backend
from kairos.engines.base import EngineBackend, StepOutput
from kairos.engines.emulated import emulated_output
from kairos.engines.vllm.plugin.protocol import DeflectedChunk, EngineSnapshot, PrefillChunk, StepRecord, encode
from kairos.services.node_agent.config import AgentConfig
from tests.factories import tiny_model
from tests.unit.test_vllm_backend_http import PARAMS, WAIT_S, StandIn, until

#: a fast engine for the emulated backend (steps of ~1-2 ms), the same profile's predictions for vLLM's
MODEL = tiny_model(prefill_intercept_ms=0.5, prefill_coef=(0.001, 0.0), decode_intercept_ms=1.0,
                   decode_coef=(0.01, 0.00001), mixed_delta_coef=(0.001, 0.0, 0.0, 0.0))
PROMPT, OUT, CHI = 40, 5, 16


def request(rid: str, prompt: int = PROMPT, out: int = OUT, sampling: SamplingParams | None = None) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=out,
                            prompt_token_ids=list(range(3, 3 + prompt)), created_unix_ms=0.0, deadline_unix_ms=1e15,
                            sampling=sampling or SamplingParams())


class Events:
    """The agent's side of EngineEvents: every call in order, and the backend's state at each token."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.steps: list[StepOutput] = []
        self.states: dict[tuple[str, int], tuple[int, int]] = {}  #: (rid, token index) -> (B, K) then
        self.finish: dict[tuple[str, int], str | None] = {}  #: (rid, token index) -> the finish reason it came with
        self.stop: dict[tuple[str, int], str | int | None] = {}  #: (rid, token index) -> its stop_reason
        self.finished_stop: dict[str, str | int | None] = {}  #: rid -> the stop_reason its finish came with
        self.backend: EngineBackend | None = None
        self.changed = asyncio.Condition()

    async def _add(self, *call: Any) -> None:
        async with self.changed:
            self.calls.append(call)
            self.changed.notify_all()

    async def on_step(self, out: StepOutput) -> None:
        self.steps.append(out)
        await self._add("step", out.step)

    async def on_allocated(self, rids: list[str]) -> None:
        for rid in rids:
            await self._add("allocated", rid)

    async def on_prefill_done(self, rid: str) -> None:
        await self._add("prefill_done", rid)

    async def on_tokens(self, rid: str, first_index: int, count: int, text: str,
                        finish_reason: str | None = None, stop_reason: str | int | None = None,
                        token_ids: list[int] | None = None) -> None:
        st = self.backend.state()
        self.states[(rid, first_index)] = (st.batch_size, st.kv_tokens)
        self.finish[(rid, first_index)] = finish_reason
        self.stop[(rid, first_index)] = stop_reason
        await self._add("tokens", rid, first_index, count)

    async def on_finished(self, rid: str, finish_reason: str, cached_tokens: int,
                          stop_reason: str | int | None = None) -> None:
        self.finished_stop[rid] = stop_reason
        await self._add("finished", rid, finish_reason)

    async def on_failed(self, rid: str, status: int, code: Any, message: str) -> None:
        await self._add("failed", rid, code, message)

    def of(self, rid: str) -> list[tuple]:
        return [c for c in self.calls if len(c) > 1 and c[1] == rid and c[0] != "step"]

    async def wait(self, *call: Any) -> None:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: call in self.calls), WAIT_S)


# -- the stand-in vLLM engine ------------------------------------------------------------------------
class StandInEngine:
    """A vLLM server (HTTP) and its plugin's state stream (ZMQ PUB) in one: each request it serves
    runs as steps, each step published (and read by ``backend``) before what it produced is answered.
    Output token i has id ``TOKEN0 + i``; a ``stop_token_ids`` id ends the output as vLLM's
    ``check_stop`` does (``finish_reason`` ``stop``, the id as ``stop_reason``)."""

    TOKEN0 = 100

    def __init__(self, addr: str) -> None:
        self.http = StandIn()
        self.http.completions = self.complete
        self.sock = zmq.asyncio.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.seq = self.step_no = 0
        self.backends: list[Any] = []
        self.hang: set[str] = set()  #: request ids the engine keeps running until the test ends
        self.release = asyncio.Event()

    async def publish(self, b: int = 0, k: int = 0, record: StepRecord | None = None) -> None:
        """Publish one snapshot and wait until every backend read it (the first ones may be lost
        before a subscriber's connection is up: re-sent until read)."""
        while True:
            self.seq += 1
            seen = [be.snapshots for be in self.backends]
            await self.sock.send(encode(EngineSnapshot(
                seq=self.seq, sent_unix_ms=0.0, engine_pid=1, step=self.step_no, batch_size=b, kv_tokens=k, waiting=[],
                num_running=b, num_waiting=0, kv_cache_usage=0.0, free_kv_tokens=100_000, block_size=16,
                step_record=record)))
            with contextlib.suppress(AssertionError):
                await until(lambda: all(be.snapshots > n for be, n in zip(self.backends, seen)), "read", 0.2)
                return

    async def step(self, b: int, k: int, prefill: int = 0, chunks: list[DeflectedChunk] = (),
                   prefills: list[PrefillChunk] = ()) -> None:
        self.step_no += 1
        await self.publish(b, k, StepRecord(step=self.step_no, started_unix_ms=0.0, wall_ms=1.0, prefill_tokens=prefill,
                                            decode_count=b, kv_tokens=k, cached_tokens=0, chunks=list(chunks),
                                            first_scheduled=[p.request_id for p in prefills], prefills=list(prefills)))

    async def complete(self, body: dict[str, Any]) -> web.StreamResponse:
        rid, prompt = body["vllm_xargs"]["kairos_rid"], len(body["prompt"])
        if rid in self.hang:
            await self.release.wait()
        if not body["stream"]:  # a keep-path prefill: one step computes the prompt, the answer names its blocks
            await self.step(0, 0, prompt, prefills=[PrefillChunk(rid, prompt, 0)])
            await self.publish()
            return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": prompt},
                                      "kv_transfer_params": {**PARAMS, "remote_request_id": rid}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(self.http_request)
        if "kairos_prefill_chunks" in body["vllm_xargs"]:  # a deflected prefill: one chunk, the whole prompt
            await self.step(0, 0, prompt, chunks=[DeflectedChunk(rid, 0, prompt, 0)])
        n, stop_ids = body["max_tokens"], body.get("stop_token_ids") or []
        for i in range(n):  # vLLM 0.32: the last token's delta carries the finish reason (and stop_reason)
            tid = self.TOKEN0 + i
            last = i == n - 1 or tid in stop_ids
            await self.step(1, prompt + i + 1)
            if last:
                await self.publish()  # idle again before the finish
            finish = ("stop" if tid in stop_ids else "length") if last else None
            await resp.write(sse({"choices": [{"text": f" t{i}", "token_ids": [tid], "finish_reason": finish,
                                               "stop_reason": tid if tid in stop_ids else None}]}))
            if last:
                n = i + 1
                break
        await resp.write(sse({"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n}})
                         + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = self.http.app()

        @web.middleware
        async def keep_request(request: web.Request, handler):  # the streaming answer needs its request
            self.http_request = request
            return await handler(request)
        app.middlewares.insert(0, keep_request)
        return app

    def close(self) -> None:
        self.release.set()
        self.sock.close(linger=0)


def sse(*objs: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps(o)}\n\n".encode() for o in objs)


# -- one harness per backend -------------------------------------------------------------------------
class Harness:
    """Backends of one kind running against one engine (or engine model) each; the test's view."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.events = Events()  #: the last started backend's
        self.runs: list[tuple[asyncio.Event, asyncio.Task]] = []
        self.engine: StandInEngine | None = None
        self.url = self.addr = ""

    async def start(self, role: str) -> EngineBackend:
        extra = {}
        if self.name == "vllm":
            extra = dict(backend="vllm", engine_url=self.url, engine_state_addr=self.addr)
        b = make_backend(AgentConfig(node_id=f"{role}-0", role=role, metrics_port=-1, **extra), MODEL)
        self.events = Events()
        self.events.backend = b
        stop = asyncio.Event()
        self.runs.append((stop, asyncio.create_task(b.run(self.events, stop))))
        if self.engine is not None:
            self.engine.backends.append(b)
            await until(lambda: b.available, "the engine's server answering")
            await self.engine.publish()
        return b

    async def wait_running(self, rid: str) -> None:
        """Until the engine works on ``rid`` (a step computed part of it / the server got it)."""
        if self.engine is not None:
            await until(lambda: any(x["vllm_xargs"]["kairos_rid"] == rid for x in self.engine.http.bodies), rid)
        else:
            await until(lambda: any(rid in {c[0] for c in s.prefill_chunks} for s in self.events.steps), rid)

    def keep_running(self, rid: str) -> None:
        """Make the engine keep ``rid`` in flight until the test ends (a long prompt / a server that waits)."""
        if self.engine is not None:
            self.engine.hang.add(rid)

    def token_id(self, req: InferenceRequest, i: int) -> int:
        """The id of output token ``i`` of ``req`` on this backend's engine."""
        return self.engine.TOKEN0 + i if self.engine is not None else emulated_output(req).token_id(i)

    async def close(self) -> None:
        for stop, task in self.runs:
            stop.set()
            await asyncio.wait_for(task, WAIT_S)


@pytest.fixture(params=sorted(BACKENDS))
async def harness(request) -> AsyncIterator[Harness]:
    h = Harness(request.param)
    if h.name != "vllm":
        yield h
        await h.close()
        return
    run_dir = tempfile.mkdtemp(prefix="kbc", dir="/tmp")  # ipc paths must stay short
    h.addr = f"ipc://{run_dir}/engine.sock"
    h.engine = StandInEngine(h.addr)
    async with TestServer(h.engine.app()) as server:
        h.url = str(server.make_url("")).rstrip("/")
        try:
            yield h
        finally:
            h.engine.close()
            await h.close()
            shutil.rmtree(run_dir, ignore_errors=True)


def test_every_registered_backend_is_an_engine_backend():
    assert {"emulated", "vllm"} <= set(BACKENDS)
    for name in BACKENDS:
        assert issubclass(backend_class(name), EngineBackend)
    with pytest.raises(ValueError, match="unknown engine backend 'sglang' .known: emulated, vllm"):
        backend_class("sglang")


async def prefilled(h: Harness, rid: str) -> tuple[EngineBackend, dict | None]:
    """A prefill backend that computed ``rid``'s prompt: (the backend, its handoff params)."""
    p = await h.start("prefill")
    p.add_prefill(request(rid))
    await h.events.wait("prefill_done", rid)
    assert p.phase(rid) == RequestPhase.HELD
    return p, p.handoff_params(rid)


async def test_a_prefill_is_computed_reported_once_and_held_until_released(harness):
    p, params = await prefilled(harness, "p1")
    assert params is None or isinstance(params, dict)
    assert harness.events.of("p1") == [("prefill_done", "p1")]  # no token: the keep path's come from the decode node
    assert any("p1" in {c[0] for c in s.prefill_chunks} for s in harness.events.steps)
    p.release("p1")
    assert p.phase("p1") is None and p.abort("p1") is False


async def test_a_remote_decode_is_allocated_pulled_and_decodes_its_tokens_in_order(harness):
    _p, params = await prefilled(harness, "k1")
    d = await harness.start("decode")
    d.add_remote_decode(request("k1"), params)
    allocated = d.take_allocated()
    if "k1" not in allocated:
        await harness.events.wait("allocated", "k1")
    ms = await d.pull_kv("prefill-0", "k1", PROMPT)
    assert ms >= 0.0
    if d.phase("k1") == RequestPhase.AWAITING_KV:
        d.kv_arrived("k1")
    await harness.events.wait("finished", "k1", "length")
    calls = [c for c in harness.events.of("k1") if c[0] != "allocated"]
    assert [c[0] for c in calls] == ["tokens"] * OUT + ["finished"]
    assert [c[2] for c in calls[:-1]] == list(range(OUT)) and d.phase("k1") is None
    assert [harness.events.finish[("k1", i)] for i in range(OUT)] == [None] * (OUT - 1) + ["length"]
    assert allocated.count("k1") + sum(c == ("allocated", "k1") for c in harness.events.calls) == 1


async def test_a_deflection_reports_its_chunks_then_its_tokens_and_the_state_shows_the_decode(harness):
    d = await harness.start("decode")
    d.add_deflected(request("f1"), [CHI])
    await harness.events.wait("finished", "f1", "length")
    ev = harness.events
    calls = ev.of("f1")
    assert calls == [("tokens", "f1", i, 1) for i in range(OUT)] + [("finished", "f1", "length")]
    # the last token comes with the finish reason (the client's last chunk carries it, as vLLM's)
    assert [ev.finish[("f1", i)] for i in range(OUT)] == [None] * (OUT - 1) + ["length"]
    first_token = ev.calls.index(("tokens", "f1", 0, 1))
    chunked = [s for s in ev.steps if s.deflected_chunk is not None and s.deflected_chunk[0] == "f1"]
    assert chunked and all(s.deflected_chunk[2] == CHI for s in chunked)  # χ of the schedule
    assert ev.calls.index(("step", chunked[0].step)) < first_token  # the chunks ran before the first token
    steps = [s.step for s in ev.steps]
    assert steps == sorted(set(steps)) and all(s.wall_ms >= 0 and s.predicted_ms > 0 for s in ev.steps)
    for i in range(OUT - 1):  # while it decodes: B counts it, K at least its prompt
        b, k = ev.states[("f1", i)]
        assert b >= 1 and k >= PROMPT, (i, b, k)
    await until(lambda: d.state().batch_size == 0, "B back to 0 once it finished")


async def test_a_stop_token_id_ends_the_request_and_is_its_stop_reason(harness):
    d = await harness.start("decode")
    ids = [harness.token_id(request("s1"), i) for i in range(OUT)]
    target = ids[2]
    last = ids.index(target)  # its first occurrence ends the output
    d.add_deflected(request("s1", sampling=SamplingParams(stop_token_ids=[target])), [CHI])
    await harness.events.wait("finished", "s1", "stop")
    ev = harness.events
    assert [c for c in ev.of("s1") if c[0] == "tokens"] == [("tokens", "s1", i, 1) for i in range(last + 1)]
    assert [ev.finish[("s1", i)] for i in range(last + 1)] == [None] * last + ["stop"]
    assert [ev.stop[("s1", i)] for i in range(last + 1)] == [None] * last + [target]
    assert ev.finished_stop["s1"] == target
    # without a stop: no stop_reason (length)
    d.add_deflected(request("s2"), [CHI])
    await harness.events.wait("finished", "s2", "length")
    assert ev.finished_stop["s2"] is None and all(ev.stop[("s2", i)] is None for i in range(OUT))


async def test_an_aborted_request_is_gone_and_reports_nothing_more(harness):
    d = await harness.start("decode")
    harness.keep_running("a1")
    d.add_deflected(request("a1", prompt=4000), [CHI])
    await harness.wait_running("a1")
    assert d.abort("a1") is True
    assert d.phase("a1") is None and d.abort("a1") is False and d.abort("never-added") is False
    reported = len(harness.events.of("a1"))
    d.add_deflected(request("after"), [CHI])  # a request after it runs to its end ...
    await harness.events.wait("finished", "after", "length")
    assert len(harness.events.of("a1")) == reported == 0  # ... and nothing of the aborted one came


async def test_a_duplicate_request_id_is_refused_with_a_value_error(harness):
    d = await harness.start("decode")
    harness.keep_running("dup")
    d.add_deflected(request("dup"), [CHI])
    with pytest.raises(ValueError):
        d.add_deflected(request("dup"), [CHI])
    d.abort("dup")
