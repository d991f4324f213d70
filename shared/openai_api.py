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


#: Largest integer accepted in an integer field (int32, as the engines use); above it: out of range.
MAX_INT_FIELD = 2**31 - 1

#: Chat roles accepted in ``messages[].role``.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_field(body: dict, name: str, default: int | None, lo: int) -> int | None:
    v = body.get(name, default)
    if v is None:
        return default
    if _is_number(v) and (v > MAX_INT_FIELD or v < -MAX_INT_FIELD - 1):  # also 1e26 (a JSON float)
        raise ApiError(400, f"'{name}' is out of range: {v:g} is above the maximum {MAX_INT_FIELD}"
                       if v > 0 else f"'{name}' is out of range: {v:g}", param=name, code="invalid_value")
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {_show(v)}", param=name, code="invalid_type")
    if v < lo:
        raise ApiError(400, f"'{name}' must be >= {lo}, got {v}", param=name, code="invalid_value")
    return v


def _show(v: Any) -> str:
    """A JSON value for an error message: its type and (short) value."""
    kind = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(v), "null" if v is None else type(v).__name__)
    text = repr(v)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _number_field(body: dict, name: str, lo: float, hi: float) -> None:
    """An optional number in ``[lo, hi]`` (null means the default)."""
    v = body.get(name)
    if v is None:
        return
    if not _is_number(v):
        raise ApiError(400, f"'{name}' must be a number between {lo:g} and {hi:g}, got {_show(v)}", param=name,
                       code="invalid_type")
    if not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}, got {v:g}", param=name,
                       code="invalid_value")


def _check_sampling(body: dict) -> None:
    """Type/range checks of the sampling options we accept (the emulated engine ignores their values,
    a real backend would not: a wrong type is a 400 naming the parameter, as OpenAI does)."""
    _number_field(body, "temperature", 0.0, 2.0)
    _number_field(body, "top_p", 0.0, 1.0)
    _number_field(body, "presence_penalty", -2.0, 2.0)
    _number_field(body, "frequency_penalty", -2.0, 2.0)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise ApiError(400, f"'stop' must be a string or a list of strings, got {_show(stop)}", param="stop",
                       code="invalid_type")
    seed = body.get("seed")
    if seed is not None:
        _int_field(body, "seed", None, -MAX_INT_FIELD - 1)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, f"'user' must be a string, got {_show(user)}", param="user", code="invalid_type")


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


def _completion_prompt(prompt: Any, nested: bool = False) -> tuple[str | None, list[int] | None]:
    """``prompt`` of /v1/completions: (text, None) or (None, token ids)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
        return prompt, None
    if prompt is None and not nested:
        raise ApiError(400, "'prompt' is required: a string or a list of token ids", param="prompt",
                       code="missing_required_parameter")
    if not isinstance(prompt, list):
        raise ApiError(400, f"'prompt' must be a non-empty string or a list of token ids, got {_show(prompt)}",
                       param="prompt", code="invalid_type")
    if not prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt", code="invalid_value")
    if all(_is_number(t) for t in prompt):
        bad = next((i for i, t in enumerate(prompt) if not isinstance(t, int)), None)
        if bad is not None:
            raise ApiError(400, f"'prompt' token ids must be integers; prompt[{bad}] is {_show(prompt[bad])}",
                           param="prompt", code="invalid_type")
        if any(t < 0 for t in prompt):
            raise ApiError(400, "'prompt' token ids must be >= 0", param="prompt", code="invalid_value")
        return None, list(prompt)
    if not nested and (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        if len(prompt) == 1:
            return _completion_prompt(prompt[0], nested=True)  # a batch of one
        raise ApiError(400, f"batched prompts ({len(prompt)} prompts) are not supported; send one prompt per "
                       "request", param="prompt", code="unsupported_value")
    bad = next(i for i, t in enumerate(prompt) if not _is_number(t))
    raise ApiError(400, f"'prompt' must be a string or a list of integer token ids; prompt[{bad}] is "
                   f"{_show(prompt[bad])}", param="prompt", code="invalid_type")


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
    _check_sampling(body)

    text: str | None = None
    ids: list[int] | None = None
    if endpoint == "completions":
        max_tokens = _int_field(body, "max_tokens", default_max_tokens, 1)
        text, ids = _completion_prompt(body.get("prompt"))
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
            if m["role"] not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}",
                               param=f"messages[{i}].role", code="invalid_value")
            content = m.get("content", "")
            if content is None and m["role"] == "assistant":  # an assistant turn that only called tools
                content = ""
            norm.append({"role": m["role"], "content": _chat_content(content, i)})
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


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int, prompt_param: str = "prompt") -> None:
    """Raises ApiError 400 ``context_length_exceeded`` when prompt + output exceed the context.

    ``param`` names what to shorten: ``prompt_param`` (``prompt``, chat: ``messages``) when the prompt
    alone leaves no room for a single output token, else ``max_tokens``.
    """
    if prompt_tokens + max_tokens <= max_model_len:
        return
    if prompt_tokens >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                       f"prompt is {prompt_tokens} tokens, which leaves no room for the completion. Please "
                       f"shorten the prompt.", param=prompt_param, code="context_length_exceeded")
    raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                   f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
                   f"{max_tokens} for the completion). Please reduce 'max_tokens' to at most "
                   f"{max_model_len - prompt_tokens}.", param="max_tokens", code="context_length_exceeded")


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
