"""Requests that become several routed requests: ``n`` > 1 and batched completions prompts (issue 20).

vLLM 0.32 runs ``n`` sequences of one request (``vllm/v1/engine/parallel_sampling.py``) and one
request per prompt of a batch (``vllm/entrypoints/openai/completion/serving.py``). Kairos routes
each of them on its own: :func:`expand` makes one :class:`Sub` per (prompt, j) — its own
:class:`~.relay.RequestRelay`, internal id, bus request, record and log line; they share the prompt,
so the nodes' prefix caches serve the repeats — and :class:`FanOut` merges their answers into the one
the client gets, as vLLM's server does:

* ``choices[i].index`` = prompt index × n + j (vLLM: ``output.index + prompt_idx * num_choices``);
  with a ``seed``, sub-request j samples with ``seed + j`` (vLLM's ``ParentRequest``: each child gets
  ``seed + index``);
* ``usage``: ``prompt_tokens`` once per prompt, ``completion_tokens`` summed over the choices (vLLM's
  ``num_prompt_tokens`` / ``previous_num_tokens``); ``cached_tokens`` per prompt the largest of its
  choices', summed (vLLM reports the last result's);
* a stream interleaves the choices' chunks as their tokens arrive, each with its ``index`` (chat: a
  role chunk per choice before its first token), each choice's finish reason on its last chunk, then
  one usage chunk (``stream_options.include_usage``) and ``data: [DONE]``.

Every accepted request ends with a completion or an explicit error: a sub-request that fails ends
the whole request with its error (a JSON error body before the stream opened, else an SSE error
event and ``[DONE]``), and its siblings still running are stopped with the truthful cause: an
:class:`~kairos.contracts.events.ErrorEvent` ``sibling_failed`` (:func:`stop_event`) put on each one's
relay queue, which its lifecycle ends like any error — cancelled on the nodes with that reason,
``sibling_failed`` and its status (424) in its record, log line and span, ``abort`` in
``kairos:request_success`` (vLLM's label for a sequence aborted before its end); nobody reads their
answer, and the client, still there, is not counted as gone. A sibling's token that arrives before
its stop is read is dropped; one re-submitted meanwhile (node lost) is stopped again under its new
attempt id (:meth:`SubAnswer.discard`). A client that disconnects reaches every sub-request (the
liveness watcher sees each flight's HTTP request close: 499 ``client_disconnected``). Metrics: every
sub-request is in flight and observed by the ``kairos:*`` families (TTFT, ITL, tokens, success) as
the sequence it is; ``kairos_ingress_requests_total`` counts the HTTP request once.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import msgspec
import orjson
from aiohttp import web

from kairos.contracts.errors import ErrorCode, error_type_for
from kairos.contracts.events import ErrorEvent, TokenEvent
from kairos.services.ingress.answer import Outcome
from kairos.services.ingress.http import STREAM_STARTED, clip, code_for_status, error_response
from kairos.services.ingress.openai_api.params import ParsedRequest
from kairos.services.ingress.openai_api.parse import SEED_MAX
from kairos.services.ingress.openai_api.prompt import (TokenCounter, count_prompt_tokens, decode_prompt,
                                                       resolve_max_tokens)
from kairos.services.ingress.openai_api.responses import ApiError
from kairos.services.ingress.openai_api.responses import (choice_logprobs, error_body, full_response, stream_chunk,
                                                          usage, usage_chunk)
from kairos.services.ingress.sse import GONE, SseResponse, sse_done, sse_event, sse_write


#: the response header listing every sub-request's internal id (``GET /v1/requests/<id>`` explains each)
FANOUT_HEADER = "X-Kairos-Sub-Request-Ids"
#: the ``source`` of the error event that stops a sibling of a failed sub-request (:func:`stop_event`)
STOP_SOURCE = "ingress:fanout"


def stop_event(attempt_id: str, rid: str, failed_index: int, failed_code: str, now_ms: float) -> ErrorEvent:
    """The error event that ends attempt ``attempt_id`` of a sibling of choice ``failed_index`` of
    request ``rid`` (response id), which failed with ``failed_code``: ``sibling_failed``."""
    code = ErrorCode.SIBLING_FAILED
    return ErrorEvent(request_id=attempt_id, status=code.status, code=code, source=STOP_SOURCE, sent_unix_ms=now_ms,
                      message=f"choice {failed_index} of request {rid} failed ({failed_code}): this choice was "
                              f"cancelled")


@dataclass(frozen=True)
class Sub:
    """One routed request of a fanned-out one: its choice ``index``, prompt index, request (n 1, one
    prompt) and prompt tokens (``exact``: counted by a tokenizer)."""

    index: int
    prompt_idx: int
    parsed: ParsedRequest
    prompt_tokens: int
    exact: bool


def expand(parsed: ParsedRequest, prompt_tokens: int, exact: bool, counter: TokenCounter | None,
           max_model_len: int) -> list[Sub]:
    """The sub-requests of ``parsed`` (its first prompt counted: ``prompt_tokens``/``exact``; the
    others are counted and checked against the context here).

    Raises:
        ApiError: a later prompt of the batch does not fit the context (400 naming ``prompt``).
    """
    seed = parsed.sampling.seed
    if seed is not None and seed + parsed.n - 1 > SEED_MAX:
        # vLLM (v1/engine/parallel_sampling.py) seeds choice j with seed + j, unbounded, which its own
        # engine's torch generator takes up to 2**64 - 1; but Kairos carries the seed to vLLM's HTTP
        # server, whose `seed` is at most 2**63 - 1 (a 400 there, mid-request), and wrapping would give
        # a choice another's seed: refused up front
        raise ApiError(ErrorCode.INVALID_VALUE, f"'seed' + n - 1 must be at most {SEED_MAX} (choice j is sampled "
                                                f"with seed + j); got seed {seed} with n {parsed.n}", param="seed")
    prompts = [(parsed.prompt_text, parsed.prompt_token_ids), *parsed.more_prompts]
    one = replace(parsed, n=1, more_prompts=())
    out: list[Sub] = []
    for p, (text, ids) in enumerate(prompts):
        base, pt, ex = one, prompt_tokens, exact
        if p:
            echo = None if parsed.echo_text is None else (text if text is not None else decode_prompt(ids or [], counter))
            base = replace(one, prompt_text=text, prompt_token_ids=ids, echo_text=echo)
            pt, ex = count_prompt_tokens(base, counter)
            base = resolve_max_tokens(base, pt, max_model_len)
        for j in range(parsed.n):
            sp = base.sampling
            if sp.seed is not None and j:
                sp = msgspec.structs.replace(sp, seed=sp.seed + j)
            out.append(Sub(p * parsed.n + j, p, replace(base, sampling=sp), pt, ex))
    return out


@dataclass
class _Choice:
    """What one sub-request produced so far."""

    sub: Sub
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    text_offset: int = 0
    finish_relayed: bool = False
    end: tuple[str, int, int] | None = None  #: (finish_reason, completion_tokens, cached_tokens) once complete
    stop_reason: str | int | None = None  #: the stop string / token id that ended it (DoneEvent), once complete


class FanOut:
    """The one answer of a fanned-out request (module docstring).

    Args:
        request: the client's HTTP request; parsed: its validated body (the first sub-request's);
        rid, created, headers: the response ``id``, ``created`` and headers, as :class:`~.answer.ClientAnswer`'s.
        subs: the sub-requests (:func:`expand`).
    """

    def __init__(self, request: web.Request, parsed: ParsedRequest, rid: str, created: int,
                 headers: dict[str, str], subs: list[Sub]) -> None:
        self.request, self.parsed, self.rid, self.created, self.headers = request, parsed, rid, created, headers
        self.choices = {s.index: _Choice(s) for s in subs}
        self.resp: web.StreamResponse | None = None
        self.unsent: list[bytes] = []
        self.failed: Outcome | None = None  #: the error answer, once a sub-request failed
        self.failed_by: tuple[int, str] | None = None  #: (choice index, code) of the sub-request that failed first
        self.gone = False  #: the client left (a write failed)
        self.statuses: dict[int, int] = {}  #: each sub-request's own status (its relay's outcome)
        self.stop: Callable[[int], None] = lambda _i: None  #: stop choice i if it runs (set by :func:`run_all`)

    def answer(self, index: int) -> Callable[[Callable[[], None]], "SubAnswer"]:
        """The :class:`SubAnswer` factory of choice ``index`` (the relay passes its commit callback)."""
        return lambda on_commit: SubAnswer(self, self.choices[index], on_commit)

    # -- the stream -------------------------------------------------------------------------------
    async def open(self) -> bool:
        if self.resp is None:
            self.resp = SseResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                             **self.headers})
            self.request[STREAM_STARTED] = True
            try:
                await self.resp.prepare(self.request)
            except GONE:
                self.gone = True
        return not self.gone

    def chunk(self, c: _Choice, text: str | None, finish: str | None, first: bool = False, echo: bool = False,
              logprobs: dict | None = None, stop_reason: str | int | None = None) -> dict:
        out = stream_chunk(c.sub.parsed, self.rid, self.created, text, finish, first=first, echo=echo,
                           logprobs=logprobs, stop_reason=stop_reason)
        out["choices"][0]["index"] = c.sub.index
        return out

    async def flush(self) -> bool:
        if self.unsent and self.resp is not None and not self.gone:
            ok = await sse_write(self.resp, b"".join(self.unsent))
            self.unsent.clear()
            self.gone = self.gone or not ok
        return not self.gone

    async def fail(self, index: int, status: int, code: ErrorCode | str, message: str,
                   resp: web.StreamResponse | None = None) -> Outcome:
        """Sub-request ``index`` ended with an error: the request's answer is that error (the first
        one), and the other sub-requests are stopped (``sibling_failed``). Returns the answer with
        this sub-request's own ``status`` (its record's)."""
        if self.failed is None:
            if self.resp is None:
                self.failed = (resp if resp is not None else error_response(code, message, status=status)), status
            else:
                if not self.gone:
                    await sse_done(self.resp, error_body(clip(message), error_type_for(status), None, code),
                                   before=b"".join(self.unsent))
                self.unsent.clear()
                self.failed = self.resp, status
            self.failed_by = index, str(code)
            for i in self.choices:
                if i != index:
                    self.stop(i)
        return self.failed[0], status

    # -- the end ----------------------------------------------------------------------------------
    def _usage(self) -> tuple[int, int, int]:
        prompt: dict[int, tuple[int, int]] = {}
        completion = 0
        for c in self.choices.values():
            assert c.end is not None
            completion += c.end[1]
            _pt, cached = prompt.get(c.sub.prompt_idx, (0, 0))
            prompt[c.sub.prompt_idx] = (c.sub.prompt_tokens, max(cached, c.end[2]))
        return sum(p for p, _ in prompt.values()), completion, sum(c for _, c in prompt.values())

    async def finish(self, outcomes: list[Outcome]) -> Outcome:
        """Every sub-request ended (``outcomes``): the merged answer, or the error, or 499."""
        if self.failed is not None:
            return self.failed
        if self.gone or any(s == 499 for _r, s in outcomes) or any(c.end is None for c in self.choices.values()):
            if self.resp is None or not self.resp.prepared:
                return error_response(ErrorCode.CLIENT_DISCONNECTED, "client closed the connection"), 499
            return self.resp, 499
        pt, ct, cached = self._usage()
        ordered = [self.choices[i] for i in sorted(self.choices)]
        if not self.parsed.stream:
            body: dict[str, Any] = {}
            for c in ordered:
                assert c.end is not None
                one = full_response(c.sub.parsed, self.rid, self.created, "".join(c.text), c.end[0], 0, 0, 0,
                                    c.logprobs, c.stop_reason)
                one["choices"][0]["index"] = c.sub.index
                body = body or one
                if body is not one:
                    body["choices"].append(one["choices"][0])
            body["usage"] = usage(pt, ct, cached)
            return web.Response(body=orjson.dumps(body), content_type="application/json", headers=self.headers), 200
        assert self.resp is not None
        last = [usage_chunk(self.parsed, self.rid, self.created, pt, ct, cached)] if self.parsed.include_usage else []
        await sse_done(self.resp, *last, before=b"".join(self.unsent))
        return self.resp, 200


class SubAnswer:
    """What :class:`~.relay.RequestRelay` writes to for one sub-request: :class:`~.answer.ClientAnswer`'s
    interface, writing into the :class:`FanOut` (its outcomes' responses are the fan-out's)."""

    def __init__(self, fan: FanOut, choice: _Choice, on_commit: Callable[[], None]) -> None:
        self.fan, self.c, self.on_commit = fan, choice, on_commit
        self.parsed = choice.sub.parsed
        self.sent = 0
        self.text_parts = choice.text

    @property
    def resp(self) -> web.StreamResponse | None:
        return self.fan.resp

    @property
    def delivered(self) -> int:
        return self.sent if self.parsed.stream else 0

    def discard(self) -> int:
        """The relay re-submits this sub-request (its partial output is forgotten); if the request
        already failed, the new attempt is stopped too (the first stop names the old attempt)."""
        if self.fan.failed is not None and self.fan.failed_by is not None and self.fan.failed_by[0] != self.c.sub.index:
            self.fan.stop(self.c.sub.index)
        n = len(self.c.text)
        self.c.text.clear()
        self.c.logprobs.clear()
        return n

    async def tokens(self, tok: TokenEvent, first: bool, flush: Callable[[], bool]) -> bool:
        fan, c = self.fan, self.c
        if fan.gone:
            return False
        if fan.failed is not None:  # dropped: the stop queued for this choice ends it (sibling_failed), not as gone
            return True
        if not self.parsed.stream:
            c.text.append(tok.text)
            c.logprobs.extend(tok.logprobs or ())
            return True
        if not await fan.open():
            return False
        if first:
            self.on_commit()
            if self.parsed.endpoint == "chat":
                fan.unsent.append(sse_event(fan.chunk(c, "", None, first=True)))
        lp = choice_logprobs(self.parsed, tok.logprobs, c.text_offset)
        if lp is not None and tok.logprobs:
            c.text_offset += sum(len(e.token) for e in tok.logprobs)
        fan.unsent.append(sse_event(fan.chunk(c, tok.text, tok.finish_reason, echo=first, logprobs=lp,
                                              stop_reason=tok.stop_reason)))
        c.finish_relayed = tok.finish_reason is not None
        self.sent += tok.count
        return await fan.flush() if flush() else True

    async def complete(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                       cached_tokens: int, stop_reason: str | int | None = None) -> Outcome:
        fan, c = self.fan, self.c
        c.end, c.stop_reason = (finish_reason, completion_tokens, cached_tokens), stop_reason
        if self.parsed.stream and fan.failed is None:
            if not c.finish_relayed and await fan.open():  # as vLLM when the last output has no token
                fan.unsent.append(sse_event(fan.chunk(c, None if self.parsed.endpoint == "chat" else "",
                                                      finish_reason, stop_reason=stop_reason)))
            await fan.flush()
        return fan.resp or web.Response(), 200  # type: ignore[return-value]

    async def error(self, status: int, code: ErrorCode, message: str) -> Outcome:
        return await self.fan.fail(self.c.sub.index, status, code, message)

    def gone(self) -> Outcome:
        return (self.fan.resp or error_response(ErrorCode.CLIENT_DISCONNECTED, "client closed the connection")), 499


async def run_all(fan: FanOut, relays: dict[int, Any]) -> Outcome:
    """Run the sub-requests' relays (by choice index) to their ends; a failure stops the others
    (:meth:`FanOut.fail`: :func:`stop_event` on each running one's queue, for its current attempt);
    the merged answer (:meth:`FanOut.finish`)."""
    tasks = {i: asyncio.ensure_future(r.run()) for i, r in relays.items()}

    def stop(i: int) -> None:
        r = relays[i]
        if not tasks[i].done() and fan.failed_by is not None:
            r.queue.put_nowait(stop_event(r.lc.attempt_id, fan.rid, *fan.failed_by, r.clock.now_ms()))
    fan.stop = stop
    pending = set(tasks.values())
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                resp, status = t.result()
                i = next(k for k, v in tasks.items() if v is t)
                fan.statuses[i] = status
                if status >= 400 and status != 499 and fan.failed is None:  # an error answered without
                    await fan.fail(i, status, *_error_of(resp, status), resp)  # SubAnswer.error
    finally:
        for t in tasks.values():
            if not t.done():
                t.cancel()
    return await fan.finish([t.result() for t in tasks.values()])


def _error_of(resp: web.StreamResponse, status: int) -> tuple[str, str]:
    """The code and message of an error answer a relay made itself (e.g. 503 ``enqueue_failed``):
    its OpenAI error body's, else the catalogue's code for ``status`` and a generic message."""
    body = getattr(resp, "body", None)
    try:
        err = orjson.loads(body)["error"]  # type: ignore[arg-type]
        return str(ErrorCode(err["code"])), str(err["message"])
    except Exception:  # noqa: BLE001  (not an error body of the catalogue)
        return str(code_for_status(status)), "a sub-request of this request failed"
