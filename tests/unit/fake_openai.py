"""An in-process fake OpenAI server for the unit tests of `kairos bench` (tests/unit/test_bench.py):
its own thread and event loop, port 0.

The fake's behaviour is keyed on the prompt length (exact, since bench sends token-id prompts):
see ``FakeOpenAI._respond``. Synchronisation is by events, never by sleeping; the only sleep is
the fake's deliberate first-token delay (``SLOW_FIRST_S``), which the TTFT assertions bound from below.
"""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import contextmanager
from pathlib import Path

from aiohttp import web

# prompt lengths that select a behaviour of the fake server
PL_400, PL_CLOSE, PL_STREAM_ERR, PL_MULTI, PL_SLOW, PL_HOLD_A, PL_HOLD_B, PL_STALL = 13, 17, 19, 20, 30, 40, 41, 50
PL_EMPTY_FIRST, PL_NO_USAGE = 60, 61  # an empty chunk at once, then the first text SLOW_FIRST_S later; no usage
PL_BATCH = 70  # all the token events in one write (they reach the client in one read)
DEFLECTED_PL = {PL_MULTI, PL_SLOW}
SLOW_FIRST_S = 0.15
MODEL = "fake-model"


# --- fake server ----------------------------------------------------------------------------------

class FakeOpenAI:
    """A tiny OpenAI-compatible streaming server with scripted behaviours."""

    def __init__(self, *, requests_endpoint: bool = True, metrics: bool = False,
                 models: tuple[str, ...] = (MODEL,)) -> None:
        self.requests_endpoint, self.metrics, self.models_list = requests_endpoint, metrics, models
        self.bodies: list[dict] = []
        self.decisions: dict[str, str] = {}
        self.deflect_total = 5  # pre-existing deflections: the bench must report the delta only
        self.keep_total = 7
        self.in_flight = 0
        self.max_in_flight = 0
        self.n = 0
        self.lookups = 0  #: GET /v1/requests/{id} calls
        self.b_received: asyncio.Event | None = None
        self.release: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        if self.requests_endpoint:
            app.router.add_get("/v1/requests/{rid}", self.request_info)
        if self.metrics:
            app.router.add_get("/metrics", self.metrics_view)
        return app

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models_list]})

    async def request_info(self, r: web.Request) -> web.Response:
        rid = r.match_info["rid"]
        self.lookups += 1
        if rid not in self.decisions:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.json_response({"id": rid, "decision": self.decisions[rid]})

    async def metrics_view(self, _r: web.Request) -> web.Response:
        text = ("# HELP kairos_decisions_total Routing decisions\n# TYPE kairos_decisions_total counter\n"
                f'kairos_decisions_total{{decision="deflect",policy="kairos"}} {self.deflect_total}.0\n'
                f'kairos_decisions_total{{decision="keep",policy="kairos"}} {self.keep_total}.0\n')
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, r: web.Request) -> web.StreamResponse:
        body = await r.json()
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                self.in_flight -= 1

        try:
            return await self._respond(r, body, leave)
        finally:
            leave()

    def _chunk(self, rid: str, text: str, finish: str | None = None, logprobs=None) -> dict:
        return {"id": rid, "object": "text_completion", "model": MODEL, "usage": None,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    async def _respond(self, r: web.Request, body: dict, leave) -> web.StreamResponse:
        n_prompt, n_out = len(body["prompt"]), body["max_tokens"]
        if n_prompt == PL_400:
            return web.json_response({"error": {"message": "bad things", "type": "invalid_request_error",
                                                "code": "nope"}}, status=400)
        self.n += 1
        rid = f"cmpl-{self.n:04d}"
        decision = "deflect" if n_prompt in DEFLECTED_PL else "keep"
        self.decisions[rid] = decision
        if decision == "deflect":
            self.deflect_total += 1
        else:
            self.keep_total += 1
        if n_prompt == PL_HOLD_B:
            self.b_received.set()
        if n_prompt == PL_HOLD_A:
            await self.b_received.wait()  # open loop: B must be sent while A is still unanswered
        if n_prompt == PL_STALL:
            await self.release.wait()  # never answers before the client times out
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Request-Id": rid})
        await resp.prepare(r)
        eol = "\r\n" if n_prompt == PL_MULTI else "\n"

        async def send(obj) -> None:
            raw = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}{eol}{eol}".encode()
            if n_prompt == PL_MULTI:  # split every event across two writes, mid-JSON
                await resp.write(raw[:len(raw) // 2])
                await resp.write(raw[len(raw) // 2:])
            else:
                await resp.write(raw)

        await resp.write(b": keep-alive\n\n")
        if n_prompt == PL_EMPTY_FIRST:
            await send(self._chunk(rid, ""))  # generated nothing yet: not the first token
        if n_prompt in (PL_SLOW, PL_EMPTY_FIRST):
            await asyncio.sleep(SLOW_FIRST_S)  # the delay TTFT must show, not a synchronisation
        if n_prompt == PL_MULTI:  # two tokens per chunk, counted via logprobs.tokens
            for k in range(0, n_out, 2):
                toks = [f"t{k}", f"t{k + 1}"][:n_out - k]
                await send(self._chunk(rid, "".join(toks), logprobs={"tokens": toks}))
        elif n_prompt == PL_BATCH:
            await resp.write("".join(f"data: {json.dumps(self._chunk(rid, f't{k} '))}\n\n"
                                     for k in range(n_out)).encode())
        else:
            for k in range(n_out):
                await send(self._chunk(rid, f"t{k} "))
                if n_prompt == PL_CLOSE and k == 1:
                    r.transport.close()  # connection dropped mid-stream, no [DONE]
                    return resp
                if n_prompt == PL_STREAM_ERR and k == 0:
                    await send({"error": {"message": "engine crashed", "type": "server_error", "code": "boom"}})
                    await send("[DONE]")
                    return resp
        await send(self._chunk(rid, "", finish="length"))
        if n_prompt != PL_NO_USAGE:
            await send({"id": rid, "object": "text_completion", "model": MODEL, "choices": [],
                        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                  "total_tokens": n_prompt + n_out,
                                  "prompt_tokens_details": {"cached_tokens": n_prompt // 2}}})
        leave()  # before [DONE]: a client bounded to one request cannot send the next one earlier
        await send("[DONE]")
        await resp.write_eof()
        return resp


@contextmanager
def serve(fake: FakeOpenAI, handler_cancellation: bool = False):
    """Run the fake on 127.0.0.1:<free port> in its own thread; yield its base URL. With
    ``handler_cancellation`` aiohttp cancels a handler whose client disconnects (as the Kairos
    ingress cancels a request)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        fake.loop = loop
        fake.b_received, fake.release = asyncio.Event(), asyncio.Event()
        runner = web.AppRunner(fake.app(), shutdown_timeout=1.0, access_log=None,
                               handler_cancellation=handler_cancellation)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        state["port"] = site._server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    assert ready.wait(10), "fake server did not start"
    try:
        yield f"http://127.0.0.1:{state['port']}"
    finally:
        loop.call_soon_threadsafe(fake.release.set)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)


def write_csv(path: Path, rows: list[tuple[float, int, int]]) -> Path:
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{a},{p},{o}\n" for a, p, o in rows))
    return path
