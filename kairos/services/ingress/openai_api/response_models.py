"""The response bodies of the ingress's routes, declared as msgspec models (no I/O).

Where data comes from: what :mod:`.responses`, kairos/services/ingress/{app,tokenize,readiness,records,
workload}.py answer. Where it goes: :mod:`.openapi`, the ``responses`` of ``GET /openapi.json`` (the
fuzzing tier checks every answer against them: tests/integration/test_openapi_fuzz.py). Shapes are
vLLM 0.32's response models (``vllm/entrypoints/openai/protocol.py``, ``completion/protocol.py``,
``chat_completion/protocol.py``); a field they hold that Kairos does not send is left out, and no
model forbids fields it does not name (clients ignore unknown fields, as OpenAI's SDK does).
"""

from typing import Any, Literal

import msgspec

from kairos.contracts.errors import ErrorCode


class PromptTokensDetails(msgspec.Struct):
    """``usage.prompt_tokens_details``: prompt tokens served from the engine's prefix cache."""

    cached_tokens: int


class Usage(msgspec.Struct):
    """``usage`` (vLLM ``UsageInfo``)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    """A completion choice's ``logprobs`` (vLLM ``CompletionLogProbs``)."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class TopLogprob(msgspec.Struct):
    """One of a chat token's ``top_logprobs`` (vLLM ``ChatCompletionLogProb``)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """A chat token's logprob (vLLM ``ChatCompletionLogProbsContent``)."""

    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(msgspec.Struct):
    """A chat choice's ``logprobs`` (vLLM ``ChatCompletionLogProbs``)."""

    content: list[ChatTokenLogprob] | None = None


FinishReason = str | None
#: the stop string or stop token id that ended a choice (vLLM's ``stop_reason``), else null
StopReason = str | int | None


class CompletionChoice(msgspec.Struct):
    """A ``text_completion`` choice (vLLM ``CompletionResponseChoice``)."""

    index: int
    text: str
    finish_reason: FinishReason
    logprobs: CompletionLogprobs | None = None
    stop_reason: StopReason = None


class CompletionResponse(msgspec.Struct):
    """``POST /v1/completions`` without ``stream`` (vLLM ``CompletionResponse``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(msgspec.Struct):
    """The assistant's message of a chat choice."""

    role: Literal["assistant"]
    content: str | None


class ChatChoice(msgspec.Struct):
    """A ``chat.completion`` choice (vLLM ``ChatCompletionResponseChoice``)."""

    index: int
    message: ChatMessageOut
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None
    stop_reason: StopReason = None


class ChatCompletionResponse(msgspec.Struct):
    """``POST /v1/chat/completions`` without ``stream`` (vLLM ``ChatCompletionResponse``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(msgspec.Struct):
    """A choice of a streamed ``text_completion`` chunk (vLLM ``CompletionResponseStreamChoice``)."""

    index: int
    text: str
    finish_reason: FinishReason = None
    logprobs: CompletionLogprobs | None = None
    stop_reason: StopReason = None


class ChatDelta(msgspec.Struct):
    """What a chat chunk adds to the message (vLLM ``DeltaMessage``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    """A choice of a ``chat.completion.chunk`` (vLLM ``ChatCompletionResponseStreamChoice``)."""

    index: int
    delta: ChatDelta
    finish_reason: FinishReason = None
    logprobs: ChatLogprobs | None = None
    stop_reason: StopReason = None


class CompletionChunk(msgspec.Struct):
    """One SSE event of ``POST /v1/completions`` with ``stream: true`` (``choices: []`` with ``usage``: the last)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ChatCompletionChunk(msgspec.Struct):
    """One SSE event of ``POST /v1/chat/completions`` with ``stream: true``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Model(msgspec.Struct):
    """A served model (vLLM ``ModelCard``, with its ``max_model_len`` when known)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    """``GET /v1/models``."""

    object: Literal["list"]
    data: list[Model]


class TokenizeResponse(msgspec.Struct):
    """``POST /tokenize`` (vLLM ``TokenizeResponse``); header ``X-Kairos-Token-Counts``: exact or estimate."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    """``POST /detokenize`` (vLLM ``DetokenizeResponse``)."""

    prompt: str


class VersionResponse(msgspec.Struct):
    """``GET /version``: the Kairos version."""

    version: str


class HealthReason(msgspec.Struct):
    """Why the ingress is not ready (``code``: ``nats_disconnected``, ``no_cluster_view``, …)."""

    code: str
    message: str


class Routable(msgspec.Struct):
    """The nodes requests can be routed to, by role."""

    prefill: list[str]
    decode: list[str]


class HealthResponse(msgspec.Struct):
    """``GET /health`` (200 ready, 503 not; docs/services.md): ``status`` ``ok`` or the first reason's code."""

    status: str
    reasons: list[HealthReason]
    routable: Routable
    draining: list[str]
    view_age_ms: float | None
    dispatchers: dict[str, Any]


class RequestRecord(msgspec.Struct):
    """``GET /v1/requests/{id}``: why a request went where it went (kairos/services/ingress/records.py
    ``request_record``; docs/services.md)."""

    id: str
    client_request_id: str | None
    policy: str | None
    decision: str | None
    reason: str | None
    node: str | None
    decode_node: str | None
    chunk_schedule: list[int]
    estimates: dict[str, Any] | None
    measured: dict[str, Any]
    routing: dict[str, Any] | None
    attempts: list[dict[str, Any]]
    records: dict[str, dict[str, Any] | None]


class DrainResponse(msgspec.Struct):
    """``POST /v1/admin/nodes/{node}/drain``: 202, the drain request went out."""

    node: str
    draining: bool
    was_draining: bool
    drain_timeout_note: str


class WorkloadRequest(msgspec.Struct):
    """One ended request of ``GET /v1/admin/workload``."""

    request_id: str
    arrival_unix_ms: float
    prompt_tokens: int | None
    output_tokens: int | None
    status: int | None


class WorkloadResponse(msgspec.Struct):
    """``GET /v1/admin/workload``: the requests that ended in the window (kairos/plan/live.py reads it)."""

    window_s: float
    now_unix_ms: float
    truncated: bool
    skipped: int
    requests: list[WorkloadRequest]


class ErrorObject(msgspec.Struct):
    """OpenAI's error object: ``code`` one of docs/errors.md, ``type`` following from the status."""

    message: str
    type: str
    param: str | None
    code: Literal[tuple(c.value for c in ErrorCode)] | None  # type: ignore[valid-type]


class ErrorResponse(msgspec.Struct):
    """Every error answer of the ingress (``{"error": {...}}``, :func:`~.responses.error_body`)."""

    error: ErrorObject
