"""OpenAI-compatible request parsing, prompt token counting and response bodies (no I/O).

Where data comes from: the JSON bodies of ``POST /v1/completions`` and ``POST
/v1/chat/completions``. Where it goes: a :class:`ParsedRequest` the ingress turns into a
:class:`~shared.wire.InferenceRequest`, and the response/SSE bodies built here.

Prompt token counting:

* token-id prompts (``prompt: [1, 2, 3]`` or ``[[1, 2, 3]]``) are exact: the number of ids;
* text with a configured tokenizer (HF ``tokenizers``, a local ``tokenizer.json``): the
  tokenizer's count, without special tokens;
* text without a tokenizer: the **estimate** ``ceil(utf-8 bytes / 4)`` (OpenAI's rule of thumb of
  ~4 characters per token for English), at least 1. Flagged ``prompt_tokens_exact=False``.

Chat messages are rendered into one prompt text before counting with this fixed template (no
model chat template is loaded)::

    <|{role}|>\\n{content}\\n   (per message)   then   <|assistant|>\\n
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Literal

Endpoint = Literal["completions", "chat"]


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status`` plus the ``error`` object fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}`` as OpenAI returns it."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_type_for(status: int) -> str:
    """OpenAI error ``type`` for an HTTP status."""
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable"
    return "invalid_request_error"


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion request."""

    endpoint: Endpoint
    model: str
    prompt_text: str | None  #: the prompt (chat: rendered) or None for token ids
    prompt_token_ids: list[int] | None
    max_tokens: int
    stream: bool
    include_usage: bool  #: stream_options.include_usage


TokenCounter = Callable[[str], int]


def estimate_tokens(text: str) -> int:
    """The documented estimate: ceil(utf-8 bytes / 4), at least 1."""
    return max(1, math.ceil(len(text.encode("utf-8")) / 4))


def tokenizer_counter(path: str) -> TokenCounter:
    """A counter using the HF ``tokenizers`` tokenizer in the local ``tokenizer.json`` at ``path``.

    Raises:
        ValueError: the file cannot be loaded.
    """
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises plain Exception subclasses
        raise ValueError(f"cannot load tokenizer {path!r}: {exc}") from None
    return lambda text: max(1, len(tok.encode(text, add_special_tokens=False).ids))


def render_chat(messages: list[dict[str, Any]]) -> str:
    """The module docstring's fixed chat template."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def _int_field(body: dict, name: str, default: int | None, lo: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer", param=name, code="invalid_type")
    if v < lo:
        raise ApiError(400, f"'{name}' must be >= {lo}, got {v}", param=name, code="invalid_value")
    return v


def _is_token_list(x: Any) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _chat_content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                               param=f"messages[{i}].content", code="invalid_value")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content", code="invalid_type")


def parse_request(endpoint: Endpoint, body: Any, served_models: list[str], default_max_tokens: int = 16) -> ParsedRequest:
    """Validate an OpenAI request body.

    Raises:
        ApiError: 400 for a malformed body or unsupported option, 404 for an unknown model.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required", param="model", code="missing_required_parameter")
    if model not in served_models:
        raise ApiError(404, f"The model `{model}` does not exist. Served: {', '.join(served_models)}",
                       type_="not_found_error", param="model", code="model_not_found")
    n = _int_field(body, "n", 1, 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_value")
    for flag, allowed in (("echo", (None, False)), ("logprobs", (None, False)), ("best_of", (None, 1))):
        if body.get(flag) not in allowed:
            raise ApiError(400, f"'{flag}' is not supported", param=flag, code="unsupported_parameter")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream", code="invalid_type")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
    include_usage = bool(so.get("include_usage", False))

    text: str | None = None
    ids: list[int] | None = None
    if endpoint == "completions":
        max_tokens = _int_field(body, "max_tokens", default_max_tokens, 1)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_list(prompt[0])):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
            text = prompt
        elif _is_token_list(prompt):
            ids = list(prompt)
            if any(t < 0 for t in ids):
                raise ApiError(400, "token ids must be >= 0", param="prompt", code="invalid_value")
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError(400, "batched prompts are not supported; send one prompt per request",
                           param="prompt", code="unsupported_value")
        else:
            raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids", param="prompt",
                           code="invalid_type" if prompt is not None else "missing_required_parameter")
    else:
        max_tokens = _int_field(body, "max_completion_tokens", None, 1) or _int_field(body, "max_tokens",
                                                                                    default_max_tokens, 1)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages",
                           code="missing_required_parameter" if msgs is None else "invalid_type")
        norm = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]",
                               code="invalid_type")
            norm.append({"role": m["role"], "content": _chat_content(m.get("content", ""), i)})
        text = render_chat(norm)
    assert max_tokens is not None
    return ParsedRequest(endpoint=endpoint, model=model, prompt_text=text, prompt_token_ids=ids,
                         max_tokens=max_tokens, stream=stream, include_usage=include_usage)


def count_prompt_tokens(req: ParsedRequest, counter: TokenCounter | None) -> tuple[int, bool]:
    """(prompt tokens, exact?) — see the module docstring."""
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids), True
    assert req.prompt_text is not None
    if counter is not None:
        return counter(req.prompt_text), True
    return estimate_tokens(req.prompt_text), False


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Raises ApiError 400 ``context_length_exceeded`` when prompt + output exceed the context."""
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                       f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                       f"{max_tokens} for the completion).", param="max_tokens", code="context_length_exceeded")


# --------------------------------------------------------------------------------------------
# responses
# --------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(req: ParsedRequest, rid: str, created: int, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """Non-streaming response body."""
    if req.endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def stream_chunk(req: ParsedRequest, rid: str, created: int, text: str | None, finish_reason: str | None,
                 first: bool = False) -> dict[str, Any]:
    """One SSE chunk with a text delta (or only the finish reason)."""
    if req.endpoint == "completions":
        choice: dict[str, Any] = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
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


def usage_chunk(req: ParsedRequest, rid: str, created: int, prompt_tokens: int, completion_tokens: int) -> dict:
    """The final ``choices: []`` chunk carrying usage (only with stream_options.include_usage)."""
    obj = "text_completion" if req.endpoint == "completions" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def models_response(models: list[str], max_model_len: int | None = None, created: int | None = None) -> dict[str, Any]:
    """``GET /v1/models`` body (with vLLM's ``max_model_len`` extension when known)."""
    c = int(time.time()) if created is None else created
    extra = {"max_model_len": max_model_len} if max_model_len else {}
    return {"object": "list", "data": [{"id": m, "object": "model", "created": c, "owned_by": "kairos", **extra}
                                       for m in models]}
