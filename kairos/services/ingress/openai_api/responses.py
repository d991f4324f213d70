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


def full_response(req: ParsedRequest, rid: str, created: int, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """Non-streaming response body (completions with ``echo``: the prompt, then the output unless
    ``max_tokens`` was 0, as vLLM's ``request_output_to_completion_response``)."""
    if req.endpoint == "completions":
        text = echoed(req, text, True)
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
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
                 first: bool = False, echo: bool = False) -> dict[str, Any]:
    """One SSE chunk with a text delta (or only the finish reason). ``first`` (chat): the role;
    ``echo`` (completions): the first delta, which carries the ``echo`` prompt."""
    if req.endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": echoed(req, text, echo), "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
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
