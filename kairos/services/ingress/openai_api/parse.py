"""Validation of an OpenAI request body into a :class:`~.params.ParsedRequest` (no I/O).

Where data comes from: the JSON bodies of ``POST /v1/completions`` and ``POST
/v1/chat/completions``. Where it goes: the ingress, which counts the prompt (:mod:`.prompt`) and
publishes the request. Types, bounds and shapes are the request models' (:mod:`.models`, converted
by :func:`~.decode.decode`); what a model cannot say is the named checks here, vLLM 0.32's OpenAI
server's rules (``vllm/entrypoints/openai/protocol.py``, ``SamplingParams._verify_args``):

* :func:`check_known` — unknown parameters and the refused values of :data:`~.params.PARAMETERS`;
* :func:`_token_ids`, :func:`_logit_bias`, :func:`_prompts` — token ids below the served model's
  vocabulary size; a ``prompt``'s four shapes (one msgspec union cannot hold them);
* :func:`_cross_field` — ``stream_options`` only with ``stream``, greedy ``n``, ``min_tokens`` ≤
  ``max_tokens``, ``logprobs`` rules, ``response_format.json_schema`` with its type, prompts × ``n``;
* :func:`~.chat.chat_messages`, :func:`~.chat.chat_options` — the chat rules.

Every refusal is an :class:`~.responses.ApiError` naming the parameter (``param``) and an
:class:`~kairos.contracts.errors.ErrorCode`.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Any, Callable

import msgspec

from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import SamplingParams
from kairos.core.engine_model.text import EMULATED_VOCAB_SIZE
from kairos.services.ingress.openai_api import models as M
from kairos.services.ingress.openai_api.chat import chat_messages, chat_options
from kairos.services.ingress.openai_api.decode import decode, integral
from kairos.services.ingress.openai_api.fields import same, show
from kairos.services.ingress.openai_api.models import MAX_FANOUT, SEED_MAX, SEED_MIN
from kairos.services.ingress.openai_api.params import PARAMETERS, Endpoint, ParsedRequest, parameters
from kairos.services.ingress.openai_api.prompt import (ChatTemplate, TokenCounter, count_prompt_tokens, decode_prompt,
                                                       render_chat, resolve_max_tokens)
from kairos.services.ingress.openai_api.responses import ApiError

__all__ = ["SEED_MAX", "SEED_MIN", "check_known", "engine_refusal", "parse_request", "prepare_request"]

Prompt = tuple[str | None, list[int] | None]
_LOGIT_BIAS_KEY = re.compile(M.LOGIT_BIAS_KEY)


def check_known(endpoint: Endpoint, body: dict) -> None:
    """Unknown parameters and refused values are 400s naming the parameter (never accepted and ignored)."""
    known = parameters(endpoint)
    for name, value in body.items():
        p = known.get(name)
        if p is None:
            other = "chat" if endpoint == "completions" else "completions"
            hint = (f" (it is a /v1/{'chat/' if other == 'chat' else ''}completions parameter)"
                    if name in parameters(other) else "")
            raise ApiError(ErrorCode.UNKNOWN_PARAMETER,
                           f"Unrecognized request argument supplied: {name}{hint}", param=name)
        if p.support == "refused" and not any(same(integral(value), a) for a in p.allowed):  # 0.0 is 0
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           f"'{name}' is not supported by Kairos: {p.how}; got {show(value)}", param=name)


def _token_ids(ids: list[int], name: str, vocab_size: int, path: str | None = None) -> list[int]:
    """``ids`` (integers) in ``[0, vocab_size)`` (vLLM: ``_validate_stop_token_ids``); ``path``: where
    they are (a prompt of a batch)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i, t in enumerate(ids) if not 0 <= t < vocab_size)
        where = f" ({path or name}[{bad}])"
        raise ApiError(ErrorCode.INVALID_VALUE, f"'{path or name}' token id {ids[bad]}{where} is out of vocabulary: "
                                                f"ids must be >= 0 and < {vocab_size}", param=name)
    return ids


def _logit_bias(v: dict[str, float], vocab_size: int) -> dict[str, float]:
    """``{token id: bias}`` (vLLM: keys ``int()``-convertible, ids in the vocabulary, bias clamped to ±100)."""
    out: dict[str, float] = {}
    for k, b in v.items():
        if not _LOGIT_BIAS_KEY.match(k):  # the document's pattern (int() also reads non-ASCII digits)
            raise ApiError(ErrorCode.INVALID_VALUE, f"'logit_bias' key {k!r} is not an integer token id",
                           param="logit_bias")
        tid = int(k)
        if not 0 <= tid < vocab_size or not math.isfinite(b):
            raise ApiError(ErrorCode.INVALID_VALUE, f"'logit_bias' entry {k!r}: {b} needs a token id in the "
                                                    f"vocabulary (size {vocab_size}) and a finite bias",
                           param="logit_bias")
        out[str(tid)] = min(100.0, max(-100.0, b))
    return out


def _prompt(prompt: Any, vocab_size: int, path: str = "prompt") -> Prompt:
    """One prompt: (text, None) or (None, token ids); ``path`` names it in a batch (``prompt[i]``)."""
    if prompt is None and path == "prompt":
        raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER,
                       "'prompt' is required: a string or a list of token ids", param="prompt")
    if not isinstance(prompt, (str, list)):
        raise ApiError(ErrorCode.INVALID_TYPE,
                       f"'{path}' must be a non-empty string or a list of token ids, got {show(prompt)}",
                       param="prompt")
    if not prompt:
        raise ApiError(ErrorCode.INVALID_VALUE, f"'{path}' must not be empty", param="prompt")
    if isinstance(prompt, str):
        return prompt, None
    try:
        ids = msgspec.convert(prompt, list[int], strict=True)  # the common case, at C speed
    except msgspec.ValidationError:
        ids = [integral(t) for t in prompt]  # 2.0 is 2, as in integer fields
        bad = next((i for i, t in enumerate(ids) if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise ApiError(ErrorCode.INVALID_TYPE, f"'{path}' must be a string or a list of token ids, and token "
                                                   f"ids must be integers; {path}[{bad}] is {show(prompt[bad])}",
                           param="prompt") from None
    return None, _token_ids(ids, "prompt", vocab_size, path)


def _prompts(prompt: Any, vocab_size: int) -> list[Prompt]:
    """``prompt``: one, or a batch (a list of strings or of token-id lists, as vLLM's
    ``CompletionRequest.prompt``), each ``(text, None)`` or ``(None, token ids)``."""
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(isinstance(p, list) for p in prompt)):
        return [_prompt(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_prompt(prompt, vocab_size)]


def _sampling(req: M.CompletionRequest | M.ChatCompletionRequest, body: dict, vocab_size: int) -> SamplingParams:
    """The :class:`~kairos.contracts.wire.SamplingParams` that carry the validated request on the bus."""
    rf = req.response_format
    if rf is not None and (rf.type == "json_schema") != (rf.json_schema is not None):
        raise ApiError(ErrorCode.INVALID_VALUE, "'response_format.json_schema' is required with, and only with, "
                                                "\"type\": \"json_schema\"", param="response_format.json_schema")
    logprobs = req.logprobs if isinstance(req, M.CompletionRequest) else (req.top_logprobs or 0) if req.logprobs \
        else None
    return SamplingParams(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else req.stop or None,
        stop_token_ids=_token_ids(req.stop_token_ids, "stop_token_ids", vocab_size) or None
        if req.stop_token_ids is not None else None,
        min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
        logit_bias=_logit_bias(req.logit_bias, vocab_size) or None if req.logit_bias is not None else None,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        response_format=body["response_format"] if rf is not None and rf.type != "text" else None,
        logprobs=logprobs)


def _cross_field(req: M.CompletionRequest | M.ChatCompletionRequest, body: dict, n: int,
                 max_tokens: int | None, fanout: int) -> None:
    """vLLM's rules across fields (``validate_stream_options``, ``_verify_greedy_sampling``,
    ``check_logprobs``), ``min_tokens`` ≤ ``max_tokens`` and Kairos' limit of :data:`MAX_FANOUT`."""
    so = req.stream_options
    if body.get("stream_options") and not req.stream:
        raise ApiError(ErrorCode.INVALID_VALUE, "Stream options can only be defined when `stream=True`.",
                       param="stream_options")
    if so is not None and so.continuous_usage_stats:
        raise ApiError(ErrorCode.UNSUPPORTED_VALUE, "'stream_options.continuous_usage_stats': true is not supported "
                                                    "by Kairos", param="stream_options.continuous_usage_stats")
    if n > 1 and req.temperature is not None and req.temperature < 1e-5:
        raise ApiError(ErrorCode.INVALID_VALUE, f"n must be 1 when using greedy sampling, got {n}.", param="n")
    if isinstance(req, M.ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise ApiError(ErrorCode.INVALID_VALUE, "when using `top_logprobs`, `logprobs` must be set to true.",
                       param="top_logprobs")
    if isinstance(req, M.CompletionRequest) and req.echo and req.logprobs is not None:  # vLLM: prompt logprobs
        raise ApiError(ErrorCode.UNSUPPORTED_VALUE, "'logprobs' with 'echo' would need the prompt's logprobs, which "
                                                    "Kairos does not carry", param="logprobs")
    if max_tokens is not None and req.min_tokens is not None and req.min_tokens > max_tokens:
        raise ApiError(ErrorCode.INVALID_VALUE, f"'min_tokens' must be <= max_tokens ({max_tokens}), got "
                                                f"{req.min_tokens}", param="min_tokens")
    if fanout > MAX_FANOUT:
        raise ApiError(ErrorCode.INVALID_VALUE, f"{fanout // n} prompts x n={n} is {fanout} sub-requests; at most "
                                                f"{MAX_FANOUT} are allowed", param="prompt")


def engine_refusal(parsed: ParsedRequest, engine_kind: str) -> ApiError | None:
    """What the ingress of ``engine_kind`` engines (``IngressConfig.engine_kind``) refuses that
    validation accepted: ``response_format`` needs an engine that constrains its decoding (vLLM);
    the emulated engine's text is a fixed word sequence (kairos/core/engine_model/text.py)."""
    if parsed.sampling.response_format is not None and engine_kind == "emulated":
        return ApiError(ErrorCode.UNSUPPORTED_VALUE, "'response_format' (structured output) needs vLLM engines; this "
                                                     "deployment serves the emulated engine, whose text cannot follow "
                                                     "a format", param="response_format")
    if parsed.sampling.logprobs is not None and engine_kind == "emulated":
        return ApiError(ErrorCode.UNSUPPORTED_VALUE, "'logprobs' needs vLLM engines; this deployment serves the "
                                                     "emulated engine, whose text has no token probabilities",
                        param="logprobs")
    return None


def _ignored(endpoint: Endpoint, body: dict, extra: list[str]) -> tuple[str, ...]:
    """The names for ``X-Kairos-Ignored-Params``: ``ignored`` parameters set to something but their
    no-op values, and ``extra``, in :data:`~.params.PARAMETERS` order."""
    names = set(extra)
    for name, p in parameters(endpoint).items():
        if p.support == "ignored" and name in body and not any(same(body[name], v) for v in p.noop):
            names.add(name)
    return tuple(p.name for p in PARAMETERS if p.name in names)


def parse_request(endpoint: Endpoint, body: Any, served_models: list[str], default_max_tokens: int = 16,
                  vocab_size: int = EMULATED_VOCAB_SIZE, chat_template: ChatTemplate | None = None) -> ParsedRequest:
    """Validate an OpenAI request body (module docstring).

    ``max_tokens`` of the result is None for a chat request without ``max_tokens`` /
    ``max_completion_tokens``: :func:`resolve_max_tokens` sets it to the remaining context once the
    prompt is counted (vLLM's default). Token ids (prompt, ``stop_token_ids``, ``logit_bias`` keys)
    must be in ``[0, vocab_size)``.

    Raises:
        ApiError: 400 for a malformed body, an unknown parameter or a refused value (``param`` names
            it), 404 for an unknown model.
    """
    if not isinstance(body, dict):
        raise ApiError(ErrorCode.INVALID_JSON, "request body must be a JSON object")
    model = body.get("model")
    if model is None or model == "":
        raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER, "'model' is required", param="model")
    if not isinstance(model, str):
        raise ApiError(ErrorCode.INVALID_TYPE, f"'model' must be a string, got {show(model)}", param="model")
    if model not in served_models:
        raise ApiError(ErrorCode.MODEL_NOT_FOUND,
                       f"The model `{model}` does not exist. Served: {', '.join(served_models)}", param="model")
    check_known(endpoint, body)
    req = decode(M.CompletionRequest if endpoint == "completions" else M.ChatCompletionRequest, body)
    n = req.n or 1
    sampling = _sampling(req, body, vocab_size)
    prompts: list[Prompt] = [(None, None)]
    extra_ignored: list[str] = []
    if isinstance(req, M.CompletionRequest):
        max_tokens = default_max_tokens if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise ApiError(ErrorCode.INVALID_VALUE, "'max_tokens' must be >= 1 (0 only with 'echo'), got 0",
                           param="max_tokens")
        prompts = _prompts(req.prompt, vocab_size)
    else:
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tools, kwargs, extra_ignored = chat_options(req, body, chat_template is not None)
        messages = chat_messages(req.messages)
        if chat_template is None:
            text = render_chat(messages, tools)
        else:  # a one-argument template callable still works when nothing else is passed
            text = chat_template(messages, **({"tools": tools} if tools else {}), **kwargs)
        prompts = [(text, None)]
    _cross_field(req, body, n, max_tokens, len(prompts) * n)
    echo = isinstance(req, M.CompletionRequest) and bool(req.echo)
    (text, ids), more = prompts[0], tuple(prompts[1:])
    return ParsedRequest(endpoint=endpoint, model=model, prompt_text=text, prompt_token_ids=ids,
                         max_tokens=1 if echo and max_tokens == 0 else max_tokens, stream=bool(req.stream),
                         include_usage=bool(req.stream_options and req.stream_options.include_usage),
                         sampling=sampling, max_tokens_explicit=body.get("max_tokens") is not None or (
                             endpoint == "chat" and max_tokens is not None),
                         ignored=_ignored(endpoint, body, extra_ignored), echo_text=text if echo else None,
                         echo_only=echo and max_tokens == 0, n=n, more_prompts=more)


def prepare_request(endpoint: Endpoint, body: Any, served_models: list[str], counter: TokenCounter | None,
                    max_model_len: int, default_max_tokens: int = 16, vocab_size: int = EMULATED_VOCAB_SIZE,
                    chat_template: ChatTemplate | None = None,
                    before_count: Callable[[ParsedRequest], None] | None = None) -> tuple[ParsedRequest, int, bool]:
    """Everything the ingress does before accepting a request: :func:`parse_request`,
    :func:`count_prompt_tokens`, :func:`resolve_max_tokens`. Returns (request, prompt tokens, exact?).
    ``before_count`` sees the parsed request before its tokens are counted (the ingress's bus-size
    check: a prompt that cannot be routed is refused without the tokenizer's work).

    Raises:
        ApiError: as those functions, or as ``before_count``.
    """
    parsed = parse_request(endpoint, body, served_models, default_max_tokens, vocab_size, chat_template)
    if before_count is not None:
        before_count(parsed)
    if body.get("echo") and parsed.echo_text is None and parsed.prompt_token_ids is not None:
        parsed = replace(parsed, echo_text=decode_prompt(parsed.prompt_token_ids, counter))
    prompt_tokens, exact = count_prompt_tokens(parsed, counter)
    return resolve_max_tokens(parsed, prompt_tokens, max_model_len), prompt_tokens, exact
