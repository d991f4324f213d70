"""One request's wire in ``kairos bench``: the body sent, the SSE stream read back, the record made of it.

Inputs: a :class:`~kairos.core.workload.workloads.WorkloadRequest` (prompt and output lengths in
tokens), then the raw bytes of its ``text/event-stream`` response with the time each event was
parsed (seconds since the bench start; one time per event, as vLLM's client stamps them).
Outputs: the ``POST /v1/completions`` JSON body (:func:`request_body`), the events' ``data``
(:class:`SSEParser`), what the stream delivered (:class:`StreamState`: content chunks as
``(time_s, tokens)``, usage and cached tokens, server id, errors) and the
:class:`~kairos.core.workload.serving_metrics.RequestRecord` of the request (:func:`make_record`:
TTFT in ms, token times in s, the server's TTFT components in ms). Pure: no I/O, times are passed
in. The token rules are those of :mod:`kairos.cli.bench` (vLLM's ``vllm bench serve`` client).
"""

from __future__ import annotations

import codecs
import json
import math
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kairos.core.workload.serving_metrics import RequestRecord
from kairos.core.workload.workloads import WorkloadRequest


def prompt_token_ids(index: int, n: int, seed: int | None = None) -> list[int]:
    """Deterministic prompt of exactly ``n`` token ids in ``[1, 1000]`` for the ``index``-th request.

    The first two ids make the prompt unique within a run: id 0 is ``(index + o) % 1000 + 1`` and
    id 1 is ``(index // 1000) % 1000 + 1``, so two requests (index < 10⁶) never share a prefix and
    a prefix cache cannot reuse one request's KV for another (vLLM's random dataset offsets its
    token ids per request for the same reason). With a ``seed`` (``kairos bench --seed``), ``o`` is
    drawn from the seed and ids 2… are random draws from ``(seed, index)``, so a run with another
    seed sends other prompts from the first token on and cannot hit the prefix cache the previous
    run filled; the same seed gives the same prompts. ``seed=None`` (``--reuse-prompts``): the
    prompts depend on the index only (``o = 0``, id k ≥ 2 is ``(index + k) % 1000 + 1``), the same
    in every run, so a rerun on the same stack reuses the prefix cache on purpose.
    """
    if seed is None:
        ids = [(index + k) % 1000 + 1 for k in range(n)]
    else:
        import numpy as np

        s = seed % 2**64  # SeedSequence takes non-negative entropy; negative seeds map to distinct ones
        offset = int(np.random.default_rng([s, 2**32]).integers(1000))  # index < 2**32: a distinct stream
        ids = np.random.default_rng([s, index]).integers(1, 1001, n).tolist()
        if n:
            ids[0] = (index + offset) % 1000 + 1
    if n > 1:
        ids[1] = (index // 1000) % 1000 + 1
    return ids


def request_body(req: WorkloadRequest, index: int, model: str, seed: int | None = None) -> dict[str, Any]:
    """The JSON body of ``POST /v1/completions`` for one workload request (prompt: :func:`prompt_token_ids`)."""
    return {"model": model, "prompt": prompt_token_ids(index, req.prompt_tokens, seed), "max_tokens": req.output_tokens,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}


class SSEParser:
    """Incremental ``text/event-stream`` parser (WHATWG HTML "server-sent events" rules).

    :meth:`feed` takes raw bytes as they arrive and returns the ``data`` of every event completed
    by them: the event's ``data:`` lines joined with ``"\\n"`` (one leading space after the colon is
    dropped). Lines end with ``\\n``, ``\\r\\n`` or ``\\r``; a blank line ends an event; lines
    starting with ``:`` are comments (keep-alives) and ignored, as are ``event``/``id``/``retry``
    fields; an event without data lines is not returned. UTF-8 split across reads is handled.
    :meth:`close` returns a last event that lacks its blank line (lenient, like vLLM's
    ``StreamedResponseHandler``).
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += self._decoder.decode(chunk)
        out: list[str] = []
        while True:
            i = next((j for j, ch in enumerate(self._buf) if ch in "\r\n"), -1)
            if i < 0:
                break
            if self._buf[i] == "\r" and i + 1 == len(self._buf):
                break  # a "\r" at the end may be the first half of "\r\n"
            line = self._buf[:i]
            skip = 2 if self._buf.startswith("\r\n", i) else 1
            self._buf = self._buf[i + skip:]
            self._line(line, out)
        return out

    def close(self) -> list[str]:
        out: list[str] = []
        rest = self._buf + self._decoder.decode(b"", final=True)
        self._buf = ""
        for line in rest.splitlines():
            self._line(line, out)
        self._line("", out)
        return out

    def _line(self, line: str, out: list[str]) -> None:
        if not line:
            if self._data:
                out.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


async def sse_json(chunks: AsyncIterable[bytes]) -> AsyncIterator[Any]:
    """The JSON ``data`` of every event of an OpenAI stream, in order, ``[DONE]`` left out
    (:class:`SSEParser` rules). ``chunks``: the response body as it arrives (aiohttp's
    ``resp.content.iter_any()``). Raises ValueError for data that is not JSON."""
    parser = SSEParser()
    async for chunk in chunks:
        for data in parser.feed(chunk):
            if data != "[DONE]":
                yield json.loads(data)
    for data in parser.close():
        if data != "[DONE]":
            yield json.loads(data)


def error_message(err: Any) -> str:
    """The text of an OpenAI-style ``error`` object (``message (code)``), or ``str(err)``."""
    if isinstance(err, dict):
        msg = err.get("message") or err.get("msg") or json.dumps(err)
        code = err.get("code")
        return f"{msg} ({code})" if code else str(msg)
    return str(err)


def error_code(err: Any) -> str | None:
    """The group of an OpenAI-style ``error`` object: its ``code``, else its ``type`` (vLLM and
    OpenAI send both; a message may embed the request id, these do not); None if it has neither."""
    if isinstance(err, dict):
        for key in ("code", "type"):
            v = err.get(key)
            if isinstance(v, (str, int)) and not isinstance(v, bool) and str(v):
                return str(v)
    return None


def int_or_none(v: Any) -> int | None:
    """``v`` if it is an int (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass
class StreamState:
    """What one streamed response has delivered so far (pure: times are passed in).

    ``chunks`` holds ``(time_s, tokens)`` for every content chunk (seconds since the bench start),
    one entry per SSE event, with strictly increasing times: an event stamped no later than the
    previous one (events parsed from one read, a coarse clock) is moved to the next float after it,
    so each event stays one arrival and one ITL, as in ``vllm bench serve``.
    """

    chunks: list[tuple[float, int]] = field(default_factory=list)
    usage_completion_tokens: int | None = None  #: last ``usage.completion_tokens`` seen
    #: last ``usage.prompt_tokens_details.cached_tokens`` seen (prompt tokens served from the prefix
    #: cache, as OpenAI and vLLM report it); None when the server reports none
    cached_tokens: int | None = None
    server_id: str | None = None  #: the response ``id`` (request id assigned by the server)
    done: bool = False  #: ``data: [DONE]`` seen
    error: str | None = None  #: first error (an ``error`` object or malformed data)
    #: the first error's group: the ``error`` object's code (:func:`error_code`), ``malformed_sse``
    error_code: str | None = None
    _cumulative: int = 0  #: tokens accounted for by per-chunk usage

    def on_data(self, data: str, t_s: float) -> None:
        """Apply one SSE event's data that arrived at ``t_s`` (seconds)."""
        if data.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            self._fail(f"malformed SSE data: {data[:200]!r}", "malformed_sse")
            return
        if obj.get("error"):
            self._fail(error_message(obj["error"]), error_code(obj["error"]) or "stream_error")
            return
        if self.server_id is None and isinstance(obj.get("id"), str):
            self.server_id = obj["id"]
        usage = obj.get("usage")
        ct = int_or_none(usage.get("completion_tokens")) if isinstance(usage, dict) else None
        if ct is not None:
            self.usage_completion_tokens = ct
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        cached = int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        if cached is not None:
            self.cached_tokens = cached
        choices = obj.get("choices")
        if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
            return
        n = chunk_tokens(choices[0], ct, self._cumulative)
        if ct is not None:
            self._cumulative = max(self._cumulative, ct)
        if n > 0:
            if self.chunks and t_s <= self.chunks[-1][0]:
                t_s = math.nextafter(self.chunks[-1][0], math.inf)
            self.chunks.append((t_s, n))

    def _fail(self, message: str, code: str) -> None:
        if self.error is None:  # the first error wins
            self.error, self.error_code = message, code


def chunk_tokens(choice: dict[str, Any], usage_completion_tokens: int | None, counted_so_far: int) -> int:
    """Output tokens carried by one streamed choice (see the module docstring).

    Args:
        choice: ``choices[0]`` of a completions (``text``) or chat (``delta.content``) chunk.
        usage_completion_tokens: the chunk's cumulative ``usage.completion_tokens`` or None.
        counted_so_far: tokens already accounted for by earlier chunks' cumulative usage.
    """
    if usage_completion_tokens is not None:
        return max(usage_completion_tokens - counted_so_far, 0)
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        toks = lp.get("tokens") if isinstance(lp.get("tokens"), list) else lp.get("content")
        if isinstance(toks, list) and toks:
            return len(toks)
    text = choice.get("text")
    if text is None and isinstance(choice.get("delta"), dict):
        text = choice["delta"].get("content")
    return 1 if text else 0  # a role-only delta, an empty first chunk or a pure finish marker carries none


def make_record(req: WorkloadRequest, sent_s: float, chunks: Sequence[tuple[float, int]], *,
                output_tokens: int | None = None, error: str | None = None,
                record: dict[str, Any] | None = None, cached_tokens: int | None = None) -> RequestRecord:
    """Turn one request's recorded chunk arrivals into a :class:`RequestRecord`.

    Args:
        req: the workload request (id and prompt length are kept).
        sent_s: when the request was sent, seconds since the bench start (the record's arrival).
        chunks: ``(arrival_s, tokens)`` per content chunk, seconds since the bench start, in order.
        output_tokens: the server's count (final ``usage``); default: the tokens in ``chunks``.
        error: failure reason or None. A request without any token and no error gets
            ``"no output tokens in the stream"``.
        record: the server's decision record (``GET /v1/requests/{id}``) if found: ``deflected``
            is ``decision == "deflect"`` and the TTFT components (ms) come from its ``measured``
            object (server-side timestamps), so the live run has a P95 breakdown like the simulator.
        cached_tokens: the server's ``usage.prompt_tokens_details.cached_tokens``; None if not reported.

    Returns:
        ``token_times_s`` with each chunk's time repeated once per token; ``ttft_ms`` =
        (first chunk − ``sent_s``) × 1000, None without tokens.
    """
    record = record or {}
    measured = record.get("measured") if isinstance(record.get("measured"), dict) else {}

    def comp(key: str) -> float | None:
        v = measured.get(key)
        return float(v) if isinstance(v, (int, float)) else None

    times = [t for t, k in chunks for _ in range(k)]
    if not times and error is None:
        error = "no output tokens in the stream"
    return RequestRecord(
        id=req.id, arrival_s=sent_s, prompt_tokens=req.prompt_tokens,
        output_tokens=len(times) if output_tokens is None else output_tokens,
        ttft_ms=(times[0] - sent_s) * 1000.0 if times else None, token_times_s=times,
        deflected=record.get("decision") == "deflect", error=error,
        prefill_queue_ms=comp("prefill_queue_ms"), prefill_exec_ms=comp("prefill_exec_ms"),
        kv_transfer_ms=comp("kv_transfer_ms"), decode_queue_ms=comp("decode_queue_ms"), cached_tokens=cached_tokens)
