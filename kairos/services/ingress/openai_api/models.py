"""The request bodies of the ingress's OpenAI surface, declared as msgspec models (no I/O).

Where data comes from: the JSON bodies of ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize`` and ``POST /detokenize``. Where it goes: :mod:`.openapi` (the OpenAPI 3.1
document of ``GET /openapi.json``, whose request schemas are these models') and request validation.

Shapes and bounds are vLLM 0.32's request models (``vllm/entrypoints/openai/completion/protocol.py``,
``chat_completion/protocol.py``, ``vllm/entrypoints/serve/tokenize/protocol.py``) with Kairos'
narrower rules: integer fields hold int32 (:data:`MAX_INT_FIELD`, ``seed`` int64), booleans are JSON
booleans, a refused parameter's schema lists the only values Kairos takes (``Param.allowed`` of
:data:`~.params.PARAMETERS`, from which every field's description comes too: :mod:`.openapi`). What a
model cannot say stays in the validation beside them: token ids below the served model's vocabulary
size, vLLM's cross-field rules (``stream_options`` without ``stream``, ``min_tokens`` ≤
``max_tokens``, greedy ``n``, ``top_logprobs`` without ``logprobs``), prompts × ``n`` ≤ 64.

msgspec rather than pydantic (vLLM's): the wire already decodes with it (kairos/contracts/wire.py), it
generates JSON Schema 2020-12 (what OpenAPI 3.1 embeds) and adds no dependency.
"""

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from kairos.services.ingress.openai_api.params import PARAMETERS, Param

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


def int_in(lo: int, hi: int = MAX_INT_FIELD) -> Any:
    """An integer field in ``[lo, hi]`` or null (msgspec: the bound on the integer, not the union)."""
    return Annotated[int, Meta(ge=lo, le=hi)] | None


def number_in(lo: float, hi: float | None = None, lo_open: bool = False) -> Any:
    """A number field in ``[lo, hi]`` (``(lo, hi]`` when ``lo_open``) or null."""
    bounds: dict[str, float] = {"gt" if lo_open else "ge": lo}
    if hi is not None:
        bounds["le"] = hi
    return Annotated[float, Meta(**bounds)] | None


def refused(name: str) -> Any:
    """A refused parameter (:data:`~.params.PARAMETERS`): any JSON value in the model, its schema the
    values Kairos takes (``Param.allowed``); other values are 400 ``unsupported_parameter``."""
    p: Param = next(q for q in PARAMETERS if q.name == name)
    # the description makes each annotation distinct: typing caches ``Annotated`` by equality, and
    # ``{"enum": [None, 0]} == {"enum": [None, False]}``
    return Annotated[Any, Meta(description=f"{p.support}: {p.how}", extra_json_schema={"enum": list(p.allowed)})]


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


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The parameters both completion endpoints take (vLLM's ``SamplingParams`` rules)."""

    model: _TEXT
    max_tokens: int_in(1) = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int_in(1, MAX_FANOUT) = None
    temperature: number_in(0.0, 2.0) = None
    top_p: number_in(0.0, 1.0, lo_open=True) = None
    top_k: int_in(-1) = None
    min_p: number_in(0.0, 1.0) = None
    seed: int_in(SEED_MIN, SEED_MAX) = None
    stop: Stop = None
    stop_token_ids: list[_ID] | None = None
    min_tokens: int_in(0) = None
    ignore_eos: bool | None = None
    logit_bias: Annotated[dict[str, float], Meta(extra_json_schema={"propertyNames": {"pattern": "^[0-9]+$"}})] \
        | None = None
    presence_penalty: number_in(-2.0, 2.0) = None
    frequency_penalty: number_in(-2.0, 2.0) = None
    repetition_penalty: number_in(0.0, lo_open=True) = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    use_beam_search: refused("use_beam_search") = None
    allowed_token_ids: refused("allowed_token_ids") = None
    bad_words: refused("bad_words") = None
    prompt_logprobs: refused("prompt_logprobs") = None
    truncate_prompt_tokens: refused("truncate_prompt_tokens") = None
    structured_outputs: refused("structured_outputs") = None
    priority: refused("priority") = None
    cache_salt: refused("cache_salt") = None
    kv_transfer_params: refused("kv_transfer_params") = None
    vllm_xargs: refused("vllm_xargs") = None


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/completions`` (vLLM 0.32 ``CompletionRequest``)."""

    prompt: Prompt
    max_tokens: int_in(0) = None  #: ≥ 1, or 0 with ``echo`` (the validation's rule)
    echo: bool | None = None
    logprobs: int_in(0, MAX_LOGPROBS) = None
    best_of: refused("best_of") = None
    suffix: refused("suffix") = None


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


class ChatCompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/chat/completions`` (vLLM 0.32 ``ChatCompletionRequest``)."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: int_in(1) = None
    logprobs: bool | None = None
    top_logprobs: int_in(0, MAX_LOGPROBS) = None
    tools: list[Tool] | None = None
    tool_choice: refused("tool_choice") = None
    parallel_tool_calls: bool | None = None
    functions: refused("functions") = None
    function_call: refused("function_call") = None
    modalities: refused("modalities") = None
    audio: refused("audio") = None
    prediction: refused("prediction") = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: refused("service_tier") = None
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # type: ignore[valid-type]
    web_search_options: refused("web_search_options") = None
    chat_template: refused("chat_template") = None
    chat_template_kwargs: refused("chat_template_kwargs") = None
    add_generation_prompt: refused("add_generation_prompt") = None
    continue_final_message: refused("continue_final_message") = None


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
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /detokenize`` (vLLM ``DetokenizeRequest``): ids below the vocabulary size."""

    tokens: list[Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]]
    model: str | None = None
