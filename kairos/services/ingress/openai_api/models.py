"""The request bodies of the ingress's OpenAI surface, declared once as msgspec models (no I/O).

Where data comes from: the JSON bodies of ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize`` and ``POST /detokenize``. Where it goes: request validation (:mod:`.decode`,
:mod:`.parse`), the parameter table (:mod:`.params`: the README's, docs/api.md) and :mod:`.openapi`
(``GET /openapi.json``). Each parameter of the two completion endpoints is one annotated field
(:func:`P`): its type and bounds, what Kairos does with it (:class:`Support`: the levels of
docs/api.md) and its description and example in the OpenAPI document.

Shapes and bounds are vLLM 0.32's request models (``vllm/entrypoints/openai/completion/protocol.py``,
``chat_completion/protocol.py``, ``vllm/entrypoints/serve/tokenize/protocol.py``) with Kairos'
narrower rules: integer fields hold int32 (:data:`MAX_INT_FIELD`, ``seed`` int64), booleans are JSON
booleans, a refused parameter's schema lists the only values Kairos takes. What a model cannot say
stays in the validation beside them: token ids below the served model's vocabulary size, vLLM's
cross-field rules (``stream_options`` without ``stream``, ``min_tokens`` ≤ ``max_tokens``, greedy
``n``, ``top_logprobs`` without ``logprobs``), prompts × ``n`` ≤ 64.

msgspec rather than pydantic (vLLM's): the wire already decodes with it (kairos/contracts/wire.py), it
generates JSON Schema 2020-12 (what OpenAPI 3.1 embeds) and adds no dependency.
"""

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

#: Largest integer accepted in an integer field (int32, as the engines use); above it: out of range.
MAX_INT_FIELD = 2**31 - 1
#: ``seed`` range (vLLM: ``Field(ge=-2**63, le=2**63 - 1)``, vllm/entrypoints/openai/completion/protocol.py).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: Most stop strings a request may have: OpenAI's documented limit, and vLLM 0.32's
#: ``StopParam`` (``Field(max_length=envs.VLLM_MAX_STOP_STRINGS)``, default 4, vllm/envs.py).
MAX_STOP_STRINGS = 4
#: most sub-requests one request fans out into (prompts x ``n``; vLLM's ``VLLM_MAX_N_SEQUENCES`` is
#: 16384, which on Kairos would be as many routed requests)
MAX_FANOUT = 64
#: most logprobs per token (vLLM's ``ModelConfig.max_logprobs`` default, ``--max-logprobs``)
MAX_LOGPROBS = 20
#: ``reasoning_effort`` values (vLLM 0.32 ``ChatCompletionRequest.reasoning_effort``).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
#: the largest id ``/detokenize`` takes (vLLM: ``Field(ge=0, le=2**63 - 1)``)
MAX_TOKEN_ID = 2**63 - 1

Level = Literal["honoured", "refused", "accepted", "ignored"]


@dataclass(frozen=True)
class Support:
    """What Kairos does with a request parameter (docs/api.md). ``honoured``: validated, carried on the
    bus (:class:`~kairos.contracts.wire.SamplingParams` or the request) and applied by the engine as
    ``how`` says; ``refused``: a value other than ``allowed`` is a 400 ``unsupported_parameter`` naming
    it; ``accepted``: validated, not used for generation, as in vLLM; ``ignored``: validated, not acted
    on although OpenAI would: a value other than ``noop`` is named in ``X-Kairos-Ignored-Params``."""

    level: Level
    how: str
    allowed: tuple = (None,)
    noop: tuple = (None,)


def P(level: Level, how: str, example: Any = None, allowed: tuple = (None,), noop: tuple = (None,)) -> Meta:
    """A request parameter's annotation (``Annotated[type, P(...)]``): its :class:`Support` (in
    ``Meta.extra["support"]``) and the OpenAPI document's description and example (``example``: a valid
    non-default value); a refused parameter's schema is ``allowed``."""
    return Meta(description=f"{level}: {how}", examples=None if example is None else [example],
                extra_json_schema={"enum": list(allowed)} if level == "refused" else None,
                extra={"support": Support(level, how, allowed, noop)})


def R(how: str, allowed: tuple = (None,), example: Any = None) -> Meta:
    """A refused parameter (:func:`P`), declared ``Annotated[Any, R(...)]``: any JSON value in the model,
    checked against ``allowed`` by the validation (400 ``unsupported_parameter`` naming it, before its type)."""
    return P("refused", how, example, allowed)


def int_in(lo: int, hi: int = MAX_INT_FIELD) -> Any:
    """An integer field in ``[lo, hi]`` or null (msgspec: the bound on the integer, not the union)."""
    return Annotated[int, Meta(ge=lo, le=hi)] | None


def number_in(lo: float, hi: float | None = None, lo_open: bool = False) -> Any:
    """A number field in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``) or null."""
    bounds: dict[str, float] = {"gt" if lo_open else "ge": lo}
    if hi is not None:
        bounds["le"] = hi
    return Annotated[float, Meta(**bounds)] | None


_ID = Annotated[int, Meta(ge=0)]
_TEXT = Annotated[str, Meta(min_length=1)]
Stop = _TEXT | Annotated[list[_TEXT], Meta(max_length=MAX_STOP_STRINGS)] | None
#: ``prompt``: one of four shapes (msgspec takes one array type in a union: read as any JSON value,
#: checked by the validation, described here)
Prompt = Annotated[Any, Meta(extra_json_schema={"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
     "minItems": 1}]})]
#: a ``logit_bias`` key: an integer token id as vLLM reads it (``int(key)``), in ASCII digits
LOGIT_BIAS_KEY = r"^\s*[+-]?[0-9]+\s*$"
#: ``logit_bias``: ids checked against the vocabulary by the validation
LogitBias = Annotated[dict[str, float], Meta(extra_json_schema={"propertyNames": {"pattern": LOGIT_BIAS_KEY}})] | None
_VLLM = "only null (vLLM extension)"
#: shared by both endpoints' fields (each declares its own type)
_MAX_TOKENS = ("output limit (→ `finish_reason: length`); prompt + max_tokens ≤ max_model_len; ≥ 1, completions "
               "with `echo: true` ≥ 0 (as vLLM). Default: 16 (completions), the remaining context (chat)")
_LOGPROBS = ("completions: integer 0-20 (vLLM's default `max_logprobs`), not with `echo` (prompt logprobs are not "
             "carried); chat: JSON boolean. vLLM engines: passed to the engine that decodes (on the keep path the "
             "decode node emits every token the client gets, the first included), its per-token logprobs carried "
             "back on the token events; the choices' `logprobs` as vLLM's (completions `{text_offset, "
             "token_logprobs, tokens, top_logprobs}`, chat `{content: [{token, logprob, bytes, top_logprobs}]}`), "
             "per chunk when streaming. Emulated engines: 400 (no probabilities)")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``stream_options`` (vLLM ``StreamOptions``); ``continuous_usage_stats: true`` is refused."""

    include_usage: bool | None = None
    continuous_usage_stats: Annotated[bool | None, Meta(extra_json_schema={"enum": [None, False]})] = None


class JsonSchemaFormat(msgspec.Struct, omit_defaults=True):
    """``response_format.json_schema`` (vLLM ``JsonSchemaResponseFormat``)."""

    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``response_format`` (vLLM ``ResponseFormat``): ``json_schema`` only with its type."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ToolCallFunction(msgspec.Struct, omit_defaults=True):
    """``function`` of an assistant message's tool call."""

    name: str
    arguments: str = ""


class ToolCall(msgspec.Struct, omit_defaults=True):
    """One of an assistant message's ``tool_calls``."""

    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] = "function"


class TextPart(msgspec.Struct):
    """A text part of a message's ``content`` (the only kind Kairos takes)."""

    type: Literal["text"]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A chat message: OpenAI's roles or any other non-empty role (vLLM's custom roles); ``content``
    may be left out only by an assistant turn with ``tool_calls``; a ``tool`` message names its call."""

    role: _TEXT
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(msgspec.Struct, omit_defaults=True):
    """``function`` of a function tool."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(msgspec.Struct, omit_defaults=True):
    """A function tool (rendered into the prompt; only with ``tool_choice: "none"``)."""

    function: FunctionDefinition
    type: Literal["function"] = "function"


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The parameters both completion endpoints take (vLLM's ``SamplingParams`` rules)."""

    model: Annotated[_TEXT, P("honoured", "must be the served model (404 otherwise)")]
    max_tokens: Annotated[int_in(1), P("honoured", _MAX_TOKENS, 5)] = None
    stream: Annotated[bool | None, P("honoured", "SSE chunks; a JSON boolean", True)] = None
    stream_options: Annotated[StreamOptions | None, P("honoured", "only with `stream: true`; `include_usage` (JSON "
        "boolean) adds the usage chunk; `continuous_usage_stats: true` is refused", {"include_usage": True})] = None
    n: Annotated[int_in(1, MAX_FANOUT), P("honoured", "1-64 choices per prompt, each its own routed request (own "
        "internal id, own record; the shared prompt meets the prefix cache), merged into one answer: usage's "
        "`prompt_tokens` once per prompt, `completion_tokens` summed (vLLM's sums); streams interleave the choices' "
        "chunks with their `index`. With a `seed`, choice j samples with seed + j (vLLM's parallel sampling; seed + "
        "n − 1 above 2^63 − 1: 400 naming `seed`). `temperature: 0` with n > 1: 400 (vLLM's greedy rule)",
        2)] = None
    temperature: Annotated[number_in(0.0, 2.0), P("honoured", "[0, 2]; vLLM samples with it; emulated: 0 makes the "
        "output depend on the prompt only", 0.5)] = None
    top_p: Annotated[number_in(0.0, 1.0, lo_open=True), P("honoured", "(0, 1]; passed to vLLM (no effect on emulated "
        "text)", 0.9)] = None
    top_k: Annotated[int_in(-1), P("honoured", "integer ≥ -1 (0 or -1: off); passed to vLLM", 5)] = None
    min_p: Annotated[number_in(0.0, 1.0), P("honoured", "[0, 1]; passed to vLLM", 0.1)] = None
    seed: Annotated[int_in(SEED_MIN, SEED_MAX), P("honoured", "64-bit integer; emulated: the output is a function of "
        "(seed, index), without a seed of the prompt; vLLM-CPU engines (`kairos up --engine vllm`): only with "
        "temperature 0, else 400 (it would kill the engine)", 42)] = None
    stop: Annotated[Stop, P("honoured", "string or list of at most 4 non-empty strings (OpenAI's limit; vLLM's "
        "`VLLM_MAX_STOP_STRINGS`, default 4); text is cut before the match (`finish_reason: stop`, the choice's "
        "`stop_reason`: the string that matched)", ["\n"])] = None
    stop_token_ids: Annotated[list[_ID] | None, P("honoured", "token ids < vocabulary size; `finish_reason: stop`, "
        "the choice's `stop_reason`: the id (an integer)", [7])] = None
    min_tokens: Annotated[int_in(0), P("honoured", "≤ max_tokens; EOS, stop ids and stop strings do not end the "
        "output before it", 2)] = None
    ignore_eos: Annotated[bool | None, P("honoured", "JSON boolean; emulated EOS: see the emulated engine notes",
        True)] = None
    logit_bias: Annotated[LogitBias, P("honoured", "{token id: bias}, ids < vocabulary size, bias clamped to [-100, "
        "100] (as vLLM); emulated: −100 bans the id", {"7": -100})] = None
    presence_penalty: Annotated[number_in(-2.0, 2.0), P("honoured", "[-2, 2]; passed to vLLM", 0.5)] = None
    frequency_penalty: Annotated[number_in(-2.0, 2.0), P("honoured", "[-2, 2]; passed to vLLM", 0.5)] = None
    repetition_penalty: Annotated[number_in(0.0, lo_open=True), P("honoured", "> 0; passed to vLLM", 1.1)] = None
    include_stop_str_in_output: Annotated[bool | None, P("honoured", "JSON boolean; keep the stop string / stop "
        "token text", True)] = None
    skip_special_tokens: Annotated[bool | None, P("honoured", "JSON boolean; emulated: EOS shows as `</s>` when "
        "false and the EOS text is kept (`include_stop_str_in_output: true`)", False)] = None
    user: Annotated[str | None, P("accepted", "a string; not used for generation", "u")] = None
    response_format: Annotated[ResponseFormat | None, P("honoured", "`text`, `json_object` or `json_schema` (`{name, "
        "schema, strict}`); vLLM engines: passed to the engine that decodes (the keep path's decode node, the "
        "deflect path's node), which constrains its output (vLLM's structured outputs); emulated engines: 400 (the "
        "ingress knows its engine kind; emulated text cannot follow a format). vLLM's `structural_tag`: 400 (not "
        "carried)", {"type": "json_object"})] = None
    use_beam_search: Annotated[Any, R("only false (vLLM extension)", (None, False), False)] = None
    allowed_token_ids: Annotated[Any, R(_VLLM)] = None
    bad_words: Annotated[Any, R("only null or [] (vLLM extension)", (None, []))] = None
    prompt_logprobs: Annotated[Any, R(_VLLM)] = None
    truncate_prompt_tokens: Annotated[Any, R(_VLLM)] = None
    structured_outputs: Annotated[Any, R(_VLLM)] = None
    priority: Annotated[Any, R("only 0 (vLLM extension)", (None, 0), 0)] = None
    cache_salt: Annotated[Any, R("only null (vLLM extension; the node agents may set it)")] = None
    kv_transfer_params: Annotated[Any, R("only null (set by Kairos' node agents)")] = None
    vllm_xargs: Annotated[Any, R("only null (set by Kairos' node agents)")] = None


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/completions`` (vLLM 0.32 ``CompletionRequest``)."""

    prompt: Annotated[Prompt, P("honoured", "a string or token ids (< vocabulary size), or a batch: a list of "
        "strings or of token-id lists, each prompt its own routed request(s) (`choices[i].index` = prompt × n + j, "
        "as vLLM's); prompts × n ≤ 64", [1, 2, 3])]
    #: ≥ 1, or 0 with ``echo`` (the validation's rule)
    max_tokens: Annotated[int_in(0), P("honoured", _MAX_TOKENS, 5)] = None
    echo: Annotated[bool | None, P("honoured", "JSON boolean; the prompt is prepended to the text (a token-id prompt "
        "decoded by the tokenizer, else by the emulated vocabulary), in the first chunk when streaming; usage "
        "unchanged. With `max_tokens: 0` the text is the prompt alone (vLLM generates one token it does not show: "
        "`completion_tokens` 1, `finish_reason: length`)", True)] = None
    logprobs: Annotated[int_in(0, MAX_LOGPROBS), P("honoured", _LOGPROBS)] = None
    best_of: Annotated[Any, R("only 1", (None, 1), 1)] = None
    suffix: Annotated[Any, R("only null")] = None


class ChatCompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/chat/completions`` (vLLM 0.32 ``ChatCompletionRequest``)."""

    messages: Annotated[Annotated[list[ChatMessage], Meta(min_length=1)], P("honoured", "text content; roles "
        "system/developer/user/assistant/tool, and any other non-empty role, which is passed to the chat template as "
        "vLLM does (its custom roles); assistant `tool_calls` and tool results are rendered into the prompt and "
        "counted", [{"role": "user", "content": "hi"}])]
    max_completion_tokens: Annotated[int_in(1), P("honoured", "as `max_tokens` (takes precedence)", 5)] = None
    logprobs: Annotated[bool | None, P("honoured", _LOGPROBS)] = None
    top_logprobs: Annotated[int_in(0, MAX_LOGPROBS), P("honoured", "integer 0-20, > 0 only with `logprobs: true` (as "
        "vLLM); the first `top_logprobs` of the engine's most likely tokens per token", 0)] = None
    tools: Annotated[list[Tool] | None, P("honoured", "function tools (`{type: function, function: {name, "
        "description?, parameters?}}`) only with `tool_choice: \"none\"`: rendered into the prompt by the chat "
        "template and counted, no tool calls parsed out — what vLLM does with `tool_choice: \"none\"`. Without it "
        "vLLM defaults to `auto`, which needs a tool-call parser Kairos' path does not have: 400", [])] = None
    tool_choice: Annotated[Any, R("only null or \"none\" (`auto`, `required` and named tools need tool-call parsing of "
        "the output, which Kairos' path does not do)", (None, "none"), "none")] = None
    parallel_tool_calls: Annotated[bool | None, P("accepted", "JSON boolean; no effect, as in vLLM, since no tool "
        "calls are parsed", False)] = None
    functions: Annotated[Any, R("only null (deprecated tools)")] = None
    function_call: Annotated[Any, R("only null or \"none\"", (None, "none"))] = None
    modalities: Annotated[Any, R("only [\"text\"]", (None, ["text"]), ["text"])] = None
    audio: Annotated[Any, R("only null")] = None
    prediction: Annotated[Any, R("only null")] = None
    store: Annotated[bool | None, P("ignored", "JSON boolean; Kairos stores no completions (vLLM ignores it too): "
        "`true` is named in `X-Kairos-Ignored-Params`", True, noop=(None, False))] = None
    metadata: Annotated[dict[str, str] | None, P("ignored", "object of string values (OpenAI's type), for stored "
        "completions: named in `X-Kairos-Ignored-Params` (vLLM ignores it)", {"k": "v"}, noop=(None, {}))] = None
    service_tier: Annotated[Any, R("only null, \"auto\" or \"default\"", (None, "auto", "default"), "auto")] = None
    reasoning_effort: Annotated[Literal[REASONING_EFFORTS] | None,  # type: ignore[valid-type]
                                P("honoured", "none/minimal/low/medium/high/xhigh/max (vLLM's values); passed to the "
        "model's chat template as `reasoning_effort` and `enable_thinking` (≠ none), as vLLM does; with the fixed "
        "template (no `--tokenizer`) nothing uses it: named in `X-Kairos-Ignored-Params`", "low")] = None
    web_search_options: Annotated[Any, R("only null")] = None
    chat_template: Annotated[Any, R("only null (the served model's template is used)")] = None
    chat_template_kwargs: Annotated[Any, R("only null or {}", (None, {}))] = None
    add_generation_prompt: Annotated[Any, R("only true", (None, True), True)] = None
    continue_final_message: Annotated[Any, R("only false", (None, False), False)] = None


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /tokenize`` with a prompt (vLLM ``TokenizeCompletionRequest``)."""

    prompt: str
    model: str | None = None
    add_special_tokens: bool | None = None  #: default true
    return_token_strs: bool | None = None


class TokenizeChatRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /tokenize`` with a chat (vLLM ``TokenizeChatRequest``), rendered as chat completions render it."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    add_generation_prompt: Annotated[bool | None, Meta(extra_json_schema={"enum": [None, True]})] = None
    continue_final_message: Annotated[bool | None, Meta(extra_json_schema={"enum": [None, False]})] = None
    add_special_tokens: bool | None = None  #: default false
    return_token_strs: bool | None = None
    tools: list[Tool] | None = None
    #: as chat completions': only null or {} (``maxProperties`` applies to an object only)
    chat_template_kwargs: Annotated[dict[str, Any] | None, Meta(extra_json_schema={"maxProperties": 0})] = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /detokenize`` (vLLM ``DetokenizeRequest``): ids below the vocabulary size."""

    tokens: list[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]]
    model: str | None = None
