"""OpenAI response bodies: completions, SSE chunks, usage, ``/v1/models`` and the error object (no I/O).

Where data comes from: a :class:`~.params.ParsedRequest` and what the engine produced (text,
finish reason, token counts). Where it goes: the ingress's JSON answers and SSE events, shaped as
OpenAI's API and vLLM's server shape them (``vllm/entrypoints/openai/protocol.py``). An error is
``{"error": {message, type, param, code}}``: ``code`` an :class:`~kairos.contracts.errors.ErrorCode`,
``type`` following from its HTTP status (:func:`kairos.contracts.errors.error_type_for`).
"""

from __future__ import annotations

import time
from typing import Any

from kairos.contracts.errors import ErrorCode, error_type_for
from kairos.contracts.events import TokenLogprob
from kairos.services.ingress.openai_api.params import ParsedRequest


class ApiError(Exception):
    """An OpenAI-shaped error raised by request validation: ``code`` (its HTTP ``status`` and OpenAI
    ``type`` follow from it), the message, and the ``param`` it names (None: the request as a whole)."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.status = code.status
        self.type = error_type_for(code.status)

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}`` as OpenAI returns it."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: ErrorCode | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The ``usage`` object; ``prompt_tokens_details.cached_tokens`` = prompt tokens the engine served
    from its prefix cache (``DoneEvent.cached_tokens``)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choice_logprobs(req: ParsedRequest, entries: list[TokenLogprob] | None,
                    text_offset: int = 0) -> dict[str, Any] | None:
    """A choice's ``logprobs`` object for ``entries`` (one per token, :class:`TokenLogprob`), or None
    when the request did not ask for them (``SamplingParams.logprobs`` None).

    Completions: vLLM 0.32's ``CompletionLogProbs`` (``_create_completion_logprobs``,
    vllm/entrypoints/openai/completion/serving.py): ``text_offset`` (from ``text_offset``: 0, or in a
    stream where the previous chunk's tokens ended), ``token_logprobs``, ``tokens``, ``top_logprobs``
    (``{token: logprob}``, the sampled token and the ``logprobs`` most likely, as the engine gave them).
    Chat: ``{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``
    (``_create_chat_logprobs``, vllm/entrypoints/openai/chat_completion/serving.py), ``top_logprobs``
    the first ``top_logprobs`` entries of the engine's list, as vLLM's ``_get_top_logprobs`` takes
    them; logprobs below -9999 are -9999 there already. Entries are what vLLM's completions API
    returned to the node (token texts as keys), so two top tokens with the same text show once."""
    k = req.sampling.logprobs
    if k is None:
        return None
    entries = entries or []
    if req.endpoint == "completions":
        offsets, at = [], text_offset
        for e in entries:
            offsets.append(at)
            at += len(e.token)
        return {"text_offset": offsets, "token_logprobs": [e.logprob for e in entries],
                "tokens": [e.token for e in entries], "top_logprobs": [dict(e.top) for e in entries]}
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": _bytes(e.token),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in e.top[:k]]}
                        for e in entries]}


def _bytes(token: str) -> list[int]:
    """vLLM's ``bytes`` of a token: ``list(token.encode("utf-8", errors="replace"))``."""
    return list(token.encode("utf-8", errors="replace"))


def full_response(req: ParsedRequest, rid: str, created: int, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
                  logprobs: list[TokenLogprob] | None = None, stop_reason: str | int | None = None) -> dict[str, Any]:
    """Non-streaming response body (completions with ``echo``: the prompt, then the output unless
    ``max_tokens`` was 0, as vLLM's ``request_output_to_completion_response``); ``logprobs``: the
    tokens' (:func:`choice_logprobs`). Every choice has vLLM's ``stop_reason`` (``CompletionResponseChoice``
    / ``ChatCompletionResponseChoice``, dumped with its nulls): the stop string or stop token id that
    ended it, else null."""
    lp = choice_logprobs(req, logprobs)
    if req.endpoint == "completions":
        text = echoed(req, text, True)
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason,
                                  "stop_reason": stop_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                  "finish_reason": finish_reason, "stop_reason": stop_reason}
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def echoed(req: ParsedRequest, text: str | None, first: bool) -> str:
    """A completion's text (or the first streamed delta: ``first``) with the ``echo`` prompt before it
    (vLLM's ``completion_stream_generator``: the prompt in the first delta, with ``max_tokens: 0`` the
    prompt alone)."""
    text = "" if text is None or req.echo_only else text
    return (req.echo_text or "") + text if first else text


def stream_chunk(req: ParsedRequest, rid: str, created: int, text: str | None, finish_reason: str | None,
                 first: bool = False, echo: bool = False, logprobs: dict[str, Any] | None = None,
                 stop_reason: str | int | None = None) -> dict[str, Any]:
    """One SSE chunk with a text delta (or only the finish reason). ``first`` (chat): the role;
    ``echo`` (completions): the first delta, which carries the ``echo`` prompt; ``logprobs``: the
    delta's tokens' (:func:`choice_logprobs`); ``stop_reason``: the stop string or stop token id
    that ended the choice, for the chunk with the ``finish_reason``.

    ``stop_reason`` is placed as vLLM 0.32's stream generators place it (chunks dumped with
    ``exclude_unset=True``): completions set it on every chunk (``CompletionResponseStreamChoice(...,
    stop_reason=output.stop_reason)``: null until the finishing chunk), chat only on the chunk with
    the ``finish_reason`` (``ChatCompletionResponseStreamChoice``: absent from the others)."""
    stop = stop_reason if finish_reason is not None else None
    if req.endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": echoed(req, text, echo), "logprobs": logprobs,
                                  "finish_reason": finish_reason, "stop_reason": stop}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop
        obj = "chat.completion.chunk"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        out["usage"] = None
    return out


def usage_chunk(req: ParsedRequest, rid: str, created: int, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict:
    """The final ``choices: []`` chunk carrying usage (only with stream_options.include_usage)."""
    obj = "text_completion" if req.endpoint == "completions" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def models_response(models: list[str], max_model_len: int | None = None, created: int | None = None) -> dict[str, Any]:
    """``GET /v1/models`` body (with vLLM's ``max_model_len`` extension when known)."""
    c = int(time.time()) if created is None else created
    extra = {"max_model_len": max_model_len} if max_model_len else {}
    return {"object": "list", "data": [{"id": m, "object": "model", "created": c, "owned_by": "kairos", **extra}
                                       for m in models]}
