"""Validation of an OpenAI request body into a :class:`~.params.ParsedRequest` (no I/O).

Where data comes from: the JSON bodies of ``POST /v1/completions`` and ``POST
/v1/chat/completions``. Where it goes: the ingress, which counts the prompt
(:mod:`.prompt`) and publishes the request. The rules are vLLM 0.32's OpenAI server's
(``vllm/entrypoints/openai/protocol.py``, ``SamplingParams._verify_args``), plus JSON-boolean
strictness and the refusals of :data:`~.params.PARAMETERS`; every refusal is an
:class:`~.responses.ApiError` naming the parameter (``param``) and an
:class:`~kairos.contracts.errors.ErrorCode`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable

import msgspec

from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import SamplingParams
from kairos.core.engine_model.text import EMULATED_VOCAB_SIZE
from kairos.services.ingress.openai_api.params import PARAMETERS, Endpoint, ParsedRequest, parameters
from kairos.services.ingress.openai_api.prompt import (ChatTemplate, TokenCounter, count_prompt_tokens, decode_prompt,
                                                       render_chat, resolve_max_tokens)
from kairos.services.ingress.openai_api.chat import chat_messages, chat_options
from kairos.services.ingress.openai_api.fields import bool_field, int_field, is_number, number_field, same, show
from kairos.services.ingress.openai_api.responses import ApiError


#: ``seed`` range (vLLM: ``Field(ge=-2**63, le=2**63 - 1)``, vllm/entrypoints/openai/completion/protocol.py).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

#: Most stop strings a request may have: OpenAI's documented limit, and vLLM 0.32's
#: ``StopParam`` (``Field(max_length=envs.VLLM_MAX_STOP_STRINGS)``, default 4, vllm/envs.py).
MAX_STOP_STRINGS = 4


def _token_ids(v: Any, name: str, vocab_size: int) -> list[int]:
    """A list of token ids in ``[0, vocab_size)`` (vLLM: ``_validate_stop_token_ids``)."""
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise ApiError(ErrorCode.INVALID_TYPE,
                       f"'{name}' must be a list of integer token ids, got {show(v)}", param=name)
    bad = [t for t in v if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(ErrorCode.INVALID_VALUE,
                       f"'{name}' contains out-of-vocabulary token ids {bad[:5]}; the vocabulary size is "
                       f"{vocab_size}", param=name)
    return list(v)


def _logit_bias(v: Any, vocab_size: int) -> dict[str, float]:
    """``{token id: bias}`` (vLLM: keys ``int()``-convertible, ids in the vocabulary, bias clamped)."""
    if not isinstance(v, dict):
        raise ApiError(ErrorCode.INVALID_TYPE, f"'logit_bias' must be an object of token id -> bias, got {show(v)}",
                       param="logit_bias")
    out: dict[str, float] = {}
    for k, b in v.items():
        try:
            tid = int(k)
        except ValueError:
            raise ApiError(ErrorCode.INVALID_VALUE,
                           f"'logit_bias' key {k!r} is not an integer token id", param="logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise ApiError(ErrorCode.INVALID_VALUE,
                           f"'logit_bias' token id {tid} is out of vocabulary (size {vocab_size})",
                           param="logit_bias")
        if not is_number(b) or not math.isfinite(b):
            raise ApiError(ErrorCode.INVALID_TYPE, f"'logit_bias' value of {k!r} must be a number, got {show(b)}",
                           param="logit_bias")
        out[str(tid)] = min(100.0, max(-100.0, float(b)))
    return out


def _check_known(endpoint: Endpoint, body: dict) -> None:
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
        if p.support == "refused" and not any(same(value, a) for a in p.allowed):
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           f"'{name}' is not supported by Kairos: {p.how}; got {show(value)}", param=name)


def _sampling(body: dict, vocab_size: int) -> SamplingParams:
    """Type/range checks of the sampling parameters (vLLM's ``SamplingParams._verify_args`` rules) and
    the :class:`~kairos.contracts.wire.SamplingParams` that carries them on the bus."""
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise ApiError(ErrorCode.INVALID_TYPE,
                           f"'stop' must be a string or a list of strings, got {show(stop)}", param="stop")
        if any(not x for x in stop):
            raise ApiError(ErrorCode.INVALID_VALUE, "'stop' cannot contain an empty string", param="stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(ErrorCode.INVALID_VALUE, f"'stop' has {len(stop)} strings; at most {MAX_STOP_STRINGS} "
                                                    "are allowed", param="stop")
        stop = stop or None
    stop_ids = body.get("stop_token_ids")
    top_k = int_field(body, "top_k", None, -1)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(ErrorCode.INVALID_TYPE, f"'user' must be a string, got {show(user)}", param="user")
    rep = body.get("repetition_penalty")
    if rep is not None and (not is_number(rep) or not math.isfinite(rep) or rep <= 0):
        raise ApiError(ErrorCode.INVALID_TYPE if not is_number(rep) else ErrorCode.INVALID_VALUE,
                       f"'repetition_penalty' must be a finite number > 0, got {show(rep)}",
                       param="repetition_penalty")
    return SamplingParams(
        temperature=number_field(body, "temperature", 0.0, 2.0),
        top_p=number_field(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=top_k,
        min_p=number_field(body, "min_p", 0.0, 1.0),
        seed=int_field(body, "seed", None, SEED_MIN, SEED_MAX),
        stop=stop,
        stop_token_ids=None if stop_ids is None else _token_ids(stop_ids, "stop_token_ids", vocab_size) or None,
        min_tokens=int_field(body, "min_tokens", None, 0),
        ignore_eos=bool_field(body, "ignore_eos"),
        logit_bias=None if body.get("logit_bias") is None else _logit_bias(body["logit_bias"], vocab_size) or None,
        presence_penalty=number_field(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=number_field(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=None if rep is None else float(rep),
        include_stop_str_in_output=bool_field(body, "include_stop_str_in_output"),
        skip_special_tokens=bool_field(body, "skip_special_tokens"),
        response_format=_response_format(body.get("response_format")),
    )


#: most sub-requests one request fans out into (prompts x ``n``; vLLM's ``VLLM_MAX_N_SEQUENCES`` is
#: 16384, which on Kairos would be as many routed requests)
MAX_FANOUT = 64

#: most logprobs per token (vLLM's ``ModelConfig.max_logprobs`` default, ``--max-logprobs``)
MAX_LOGPROBS = 20


def _logprobs(endpoint: Endpoint, body: dict) -> int | None:
    """How many top logprobs per output token the client wants (None: no logprobs). Completions:
    ``logprobs`` an integer in [0, 20]; chat: ``logprobs: true`` with ``top_logprobs`` in [0, 20]
    (``top_logprobs`` > 0 needs ``logprobs: true``, as vLLM's ``ChatCompletionRequest.check_logprobs``).
    vLLM's -1 (the whole vocabulary) is above its default ``max_logprobs`` of 20, so refused here too."""
    if endpoint == "chat":
        on = bool_field(body, "logprobs")
        top = int_field(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top and not on:
            raise ApiError(ErrorCode.INVALID_VALUE, "when using `top_logprobs`, `logprobs` must be set to true.",
                           param="top_logprobs")
        return (top or 0) if on else None
    v = body.get("logprobs")
    if isinstance(v, bool):
        raise ApiError(ErrorCode.INVALID_TYPE, f"'logprobs' must be an integer, got {show(v)}", param="logprobs")
    if body.get("echo") is True and v is not None:  # vLLM answers it with the prompt's logprobs, not carried
        raise ApiError(ErrorCode.UNSUPPORTED_VALUE, "'logprobs' with 'echo' would need the prompt's logprobs, which "
                                                    "Kairos does not carry", param="logprobs")
    return int_field(body, "logprobs", None, 0, MAX_LOGPROBS)


def _response_format(v: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` (vLLM 0.32 ``ResponseFormat``): ``text`` (None: no constraint),
    ``json_object``, or ``json_schema`` with ``json_schema: {name, schema?, description?, strict?}``."""
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(ErrorCode.INVALID_VALUE if isinstance(v, dict) else ErrorCode.INVALID_TYPE,
                       "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"} "
                       f"(vLLM's structural tags are not carried), got {show(v)}", param="response_format")
    unknown = set(v) - {"type", "json_schema"}
    if unknown:
        raise ApiError(ErrorCode.INVALID_VALUE, f"'response_format' has unknown field(s) {sorted(unknown)}",
                       param="response_format")
    if kind == "json_schema":
        js = v.get("json_schema")
        if (not isinstance(js, dict) or not isinstance(js.get("name"), str)
                or not isinstance(js.get("schema", {}), dict) or not isinstance(js.get("strict", False), (bool, type(None)))):
            raise ApiError(ErrorCode.INVALID_TYPE, "'response_format.json_schema' must be {\"name\": string, "
                                                   "\"schema\": object, \"strict\": boolean}",
                           param="response_format.json_schema")
    elif "json_schema" in v:
        raise ApiError(ErrorCode.INVALID_VALUE, "'response_format.json_schema' needs \"type\": \"json_schema\"",
                       param="response_format.json_schema")
    return None if kind == "text" else v


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


def _integral(t: Any) -> Any:
    """An integral JSON number as that integer (``1.0`` → 1, as :func:`~.fields.int_field`); else ``t``."""
    return int(t) if isinstance(t, float) and math.isfinite(t) and t.is_integer() else t


def _completion_prompt(prompt: Any, vocab_size: int, path: str = "prompt") -> tuple[str | None, list[int] | None]:
    """``prompt`` of /v1/completions: (text, None) or (None, token ids). ``path``: where it is in the
    body (``prompt``, or ``prompt[i]`` in a batch), named in every message."""
    nested = path != "prompt"
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(ErrorCode.INVALID_VALUE, f"'{path}' must not be empty", param="prompt")
        return prompt, None
    if prompt is None and not nested:
        raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER,
                       "'prompt' is required: a string or a list of token ids", param="prompt")
    if not isinstance(prompt, list):
        raise ApiError(ErrorCode.INVALID_TYPE,
                       f"'{path}' must be a non-empty string or a list of token ids, got {show(prompt)}",
                       param="prompt")
    if not prompt:
        raise ApiError(ErrorCode.INVALID_VALUE, f"'{path}' must not be empty", param="prompt")
    if all(is_number(t) for t in prompt):
        ids = [_integral(t) for t in prompt]
        bad = next((i for i, t in enumerate(ids) if not isinstance(t, int)), None)
        if bad is not None:
            raise ApiError(ErrorCode.INVALID_TYPE,
                           f"'{path}' token ids must be integers; {path}[{bad}] is {show(prompt[bad])}",
                           param="prompt")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(ErrorCode.INVALID_VALUE,
                           f"'{path}' token id {ids[bad]} ({path}[{bad}]) is out of vocabulary: ids must be "
                           f">= 0 and < {vocab_size}", param="prompt")
        return None, ids
    bad = next(i for i, t in enumerate(prompt) if not is_number(t))
    raise ApiError(ErrorCode.INVALID_TYPE,
                   f"'{path}' must be a string or a list of integer token ids; {path}[{bad}] is "
                   f"{show(prompt[bad])}", param="prompt")


def _completion_prompts(prompt: Any, vocab_size: int) -> list[tuple[str | None, list[int] | None]]:
    """``prompt`` of /v1/completions: one prompt, or a batch (a list of strings or a list of token-id
    lists, as vLLM's ``CompletionRequest.prompt``), each ``(text, None)`` or ``(None, token ids)``."""
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(isinstance(p, list) for p in prompt)):
        return [_completion_prompt(p, vocab_size, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_completion_prompt(prompt, vocab_size)]


def parse_request(endpoint: Endpoint, body: Any, served_models: list[str], default_max_tokens: int = 16,
                  vocab_size: int = EMULATED_VOCAB_SIZE, chat_template: ChatTemplate | None = None) -> ParsedRequest:
    """Validate an OpenAI request body (the rules of vLLM 0.32's OpenAI server, plus JSON-boolean
    strictness and the refusals of :data:`~.params.PARAMETERS`).

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
    if not isinstance(model, str) or not model:
        raise ApiError(ErrorCode.MISSING_REQUIRED_PARAMETER, "'model' is required", param="model")
    if model not in served_models:
        raise ApiError(ErrorCode.MODEL_NOT_FOUND,
                       f"The model `{model}` does not exist. Served: {', '.join(served_models)}", param="model")
    _check_known(endpoint, body)
    n = int_field(body, "n", 1, 1)
    if n > MAX_FANOUT:
        raise ApiError(ErrorCode.INVALID_VALUE, f"'n' must be at most {MAX_FANOUT} (Kairos' limit on the "
                                                f"sub-requests of one request), got {n}", param="n")
    stream = bool_field(body, "stream") or False
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(ErrorCode.INVALID_TYPE, "'stream_options' must be an object", param="stream_options")
        if so and not stream:  # vLLM: CompletionRequest.validate_stream_options
            raise ApiError(ErrorCode.INVALID_VALUE,
                           "Stream options can only be defined when `stream=True`.", param="stream_options")
        unknown = set(so) - {"include_usage", "continuous_usage_stats"}
        if unknown:
            raise ApiError(ErrorCode.UNKNOWN_PARAMETER,
                           f"Unrecognized stream_options field: {sorted(unknown)[0]}", param="stream_options")
        include_usage = bool(bool_field(so, "include_usage", "stream_options.include_usage"))
        if bool_field(so, "continuous_usage_stats", "stream_options.continuous_usage_stats"):
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           "'stream_options.continuous_usage_stats' is not supported by Kairos",
                           param="stream_options")
    sampling = msgspec.structs.replace(_sampling(body, vocab_size), logprobs=_logprobs(endpoint, body))
    if n > 1 and sampling.temperature is not None and sampling.temperature < 1e-5:  # vLLM: _verify_greedy_sampling
        raise ApiError(ErrorCode.INVALID_VALUE, f"n must be 1 when using greedy sampling, got {n}.", param="n")

    text: str | None = None
    ids: list[int] | None = None
    extra_ignored: list[str] = []
    echo_only = False
    if endpoint == "completions":
        explicit = body.get("max_tokens") is not None
        echo = bool(bool_field(body, "echo"))
        max_tokens = int_field(body, "max_tokens", default_max_tokens, 0 if echo else 1)
        if echo and max_tokens == 0:  # vLLM: echo_without_generation runs one token, shows none
            echo_only, max_tokens = True, 1
        prompts = _completion_prompts(body.get("prompt"), vocab_size)
        (text, ids), more = prompts[0], tuple(prompts[1:])
        if len(prompts) * n > MAX_FANOUT:
            raise ApiError(ErrorCode.INVALID_VALUE, f"{len(prompts)} prompts x n={n} is {len(prompts) * n} "
                                                    f"sub-requests; at most {MAX_FANOUT} are allowed", param="prompt")
    else:
        mct = int_field(body, "max_completion_tokens", None, 1)
        mt = int_field(body, "max_tokens", None, 1)
        max_tokens = mct if mct is not None else mt
        explicit = max_tokens is not None
        tools, kwargs, extra_ignored = chat_options(body, chat_template is not None)
        messages = chat_messages(body.get("messages"))
        if chat_template is None:
            text = render_chat(messages, tools)
        else:  # a one-argument template callable still works when nothing else is passed
            text = chat_template(messages, **({"tools": tools} if tools else {}), **kwargs)
    if max_tokens is not None and sampling.min_tokens is not None and sampling.min_tokens > max_tokens:
        raise ApiError(ErrorCode.INVALID_VALUE,
                       f"'min_tokens' must be <= max_tokens ({max_tokens}), got {sampling.min_tokens}",
                       param="min_tokens")
    return ParsedRequest(endpoint=endpoint, model=model, prompt_text=text, prompt_token_ids=ids,
                         max_tokens=max_tokens, stream=stream, include_usage=include_usage, sampling=sampling,
                         max_tokens_explicit=explicit, ignored=_ignored(endpoint, body, extra_ignored),
                         echo_text=text if endpoint == "completions" and body.get("echo") else None,
                         echo_only=echo_only, n=n, more_prompts=more if endpoint == "completions" else ())


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
