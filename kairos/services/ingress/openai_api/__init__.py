"""The OpenAI-compatible API surface of the ingress: parameters, validation, prompt counting, bodies (no I/O).

Where data comes from: the JSON bodies of ``POST /v1/completions`` and ``POST /v1/chat/completions``.
Where it goes: a :class:`ParsedRequest` the ingress turns into a
:class:`~kairos.contracts.wire.InferenceRequest`, and the response/SSE bodies built here.

* :mod:`.params` — :data:`PARAMETERS` (every parameter Kairos knows and what it does with it, read
  from the request models' declarations; the README's table, ``python -m
  kairos.services.ingress.openai_api``) and :class:`ParsedRequest`;
* :mod:`.parse` — validation as vLLM 0.32's OpenAI server does it (:func:`parse_request`,
  :func:`prepare_request`), each refusal an :class:`ApiError` naming the parameter: the body
  converted into its model by :mod:`.decode` (msgspec's errors as OpenAI errors), then the named
  checks a model cannot say; :mod:`.chat` (messages, tools, reasoning_effort) and :mod:`.fields`
  (JSON values in messages) are its parts;
* :mod:`.prompt` — prompt token counting (tokenizer or the ``ceil(bytes / 4)`` estimate), chat
  templates, the context-length check;
* :mod:`.responses` — completion bodies, SSE chunks, usage, ``/v1/models``, the error object.
* :mod:`.models`, :mod:`.response_models` — every route's request and response bodies as msgspec
  models (each request parameter one annotated field: type, bounds, :class:`Support`); :mod:`.openapi`
  — the OpenAPI 3.1 document generated from them (``GET /openapi.json``).

The names below are re-exported so callers write ``from kairos.services.ingress import openai_api as oa``.
"""

from kairos.services.ingress.openai_api.params import (PARAMETERS, Endpoint, Level, Param, ParsedRequest, Support,
                                                       parameter_table_markdown, parameters)
from kairos.services.ingress.openai_api.chat import CHAT_MESSAGE_FIELDS, CHAT_ROLES
from kairos.services.ingress.openai_api.models import MAX_INT_FIELD
from kairos.services.ingress.openai_api.parse import SEED_MAX, SEED_MIN, engine_refusal, parse_request, prepare_request
from kairos.services.ingress.openai_api.prompt import (ChatTemplate, TokenCounter, check_context, count_prompt_tokens,
                                                       estimate_tokens, load_chat_template, load_tokenizer,
                                                       render_chat, resolve_max_tokens, tokenizer_counter)
from kairos.services.ingress.openai_api.responses import (ApiError, error_body, full_response, models_response,
                                                          stream_chunk, usage, usage_chunk)

__all__ = [
    "PARAMETERS", "Endpoint", "Level", "Param", "ParsedRequest", "Support", "parameter_table_markdown", "parameters",
    "CHAT_MESSAGE_FIELDS", "CHAT_ROLES", "MAX_INT_FIELD", "SEED_MAX", "SEED_MIN", "engine_refusal", "parse_request",
    "prepare_request",
    "ChatTemplate", "TokenCounter", "check_context", "count_prompt_tokens", "estimate_tokens", "load_chat_template",
    "load_tokenizer", "render_chat", "resolve_max_tokens", "tokenizer_counter",
    "ApiError", "error_body", "full_response", "models_response", "stream_chunk", "usage", "usage_chunk",
]
