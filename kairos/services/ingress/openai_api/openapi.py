"""The OpenAPI 3.1 document of the ingress (``GET /openapi.json``), generated from the models (no I/O).

Where data comes from: the request models (:mod:`.models`), the response models
(:mod:`.response_models`; each request parameter's description and example are its field's,
:func:`~.models.P`: the README table's ``how``) and :data:`ROUTES` below. Where it goes: ``GET /openapi.json``
(kairos/services/ingress/app.py), which gateways, client generators and API test tools read — the
fuzzing tier (tests/integration/test_openapi_fuzz.py) sends schemathesis' requests from it and checks
every answer against it. Schemas are msgspec's JSON Schema 2020-12 (``msgspec.json.schema_components``),
the dialect OpenAPI 3.1 embeds; nothing in the document is typed by hand but the routes' summaries.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec

from kairos.contracts.subjects import TOKEN_PATTERN
from kairos.services.ingress.openai_api import models as M
from kairos.services.ingress.openai_api import response_models as R

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class Route:
    """One operation of the document: its method, path, request model (or a ``oneOf`` of models), the
    model of its success answer (``None``: no JSON body), its success status and whether it streams."""

    method: str
    path: str
    operation_id: str
    summary: str
    request: tuple[type, ...] = ()
    response: type | None = None
    status: int = 200
    sse: type | None = None  #: the model of each SSE event's ``data`` (``stream: true``)
    text: str | None = None  #: a success answer that is plain text (its media type)
    open: bool = False  #: served without an API key (kairos/services/ingress/http.py ``OPEN_PATHS``)
    path_param: str | None = None
    path_pattern: str | None = None  #: the path parameter's (others: 400)
    query: tuple[tuple[str, dict[str, Any]], ...] = ()


#: every route of the ingress (kairos/services/ingress/app.py registers the same ones)
ROUTES: tuple[Route, ...] = (
    Route("post", "/v1/completions", "createCompletion", "OpenAI completions (vLLM 0.32's rules; SSE with "
          "`stream: true`)", (M.CompletionRequest,), R.CompletionResponse, sse=R.CompletionChunk),
    Route("post", "/v1/chat/completions", "createChatCompletion", "OpenAI chat completions (vLLM 0.32's rules; "
          "SSE with `stream: true`)", (M.ChatCompletionRequest,), R.ChatCompletionResponse, sse=R.ChatCompletionChunk),
    Route("get", "/v1/models", "listModels", "the served model", response=R.ModelList),
    Route("get", "/v1/requests/{id}", "getRequestRecord", "why a request went where it went (docs/services.md)",
          response=R.RequestRecord, path_param="id", path_pattern=TOKEN_PATTERN),
    Route("post", "/tokenize", "tokenize", "vLLM's: the prompt's or the chat's tokens",
          (M.TokenizeCompletionRequest, M.TokenizeChatRequest), R.TokenizeResponse),
    Route("post", "/detokenize", "detokenize", "vLLM's: the text of token ids", (M.DetokenizeRequest,),
          R.DetokenizeResponse),
    Route("get", "/version", "version", "the Kairos version", response=R.VersionResponse, open=True),
    Route("get", "/health", "health", "readiness: 200 ready, 503 with the reasons", response=R.HealthResponse,
          open=True),
    Route("post", "/v1/admin/nodes/{node}/drain", "drainNode", "an operator's drain of a node (`kairos drain`)",
          response=R.DrainResponse, status=202, path_param="node"),
    Route("get", "/v1/admin/workload", "getWorkload", "the requests that ended in the last `window_s` seconds",
          response=R.WorkloadResponse, query=(("window_s", {"type": "number", "minimum": 1, "maximum": 86400}),)),
    Route("get", "/metrics", "metrics", "Prometheus metrics", text="text/plain", open=True),
    Route("get", "/openapi.json", "openapi", "this document", text="application/json", open=True),
)

#: every request model
REQUESTS: tuple[type, ...] = tuple(m for r in ROUTES for m in r.request)


def _models() -> list[type]:
    return [R.ErrorResponse, *REQUESTS, *(r.response for r in ROUTES if r.response),
            *(r.sse for r in ROUTES if r.sse)]


def _served(components: dict[str, Any], served_model: str) -> None:
    """``model`` of each request: the served model, the only one the ingress answers (any other: 404
    ``model_not_found``)."""
    for m in REQUESTS:
        schema = components[m.__name__]
        model = schema["properties"]["model"]
        required = "model" in schema.get("required", ())
        schema["properties"]["model"] = {"description": model.get("description", "the served model"),
                                         "enum": [served_model] if required else [served_model, None]}


def _vocabulary(components: dict[str, Any], vocab_size: int) -> None:
    """Token ids in ``prompt`` and ``stop_token_ids`` of the completion requests below ``vocab_size`` (the
    served tokenizer's, as the validation checks them: kairos/services/ingress/openai_api/parse.py)."""
    def bound(schema: Any) -> None:
        if isinstance(schema, dict):
            if schema.get("type") == "integer" and schema.get("minimum") == 0:
                schema["maximum"] = vocab_size - 1
            for v in schema.values():
                bound(v)
        elif isinstance(schema, list):
            for v in schema:
                bound(v)
    for m in (M.CompletionRequest, M.ChatCompletionRequest):
        for name in ("prompt", "stop_token_ids"):
            bound(components[m.__name__]["properties"].get(name))


def _operation(r: Route) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": r.operation_id, "summary": r.summary}
    schema = {"type": "string", **({"pattern": r.path_pattern} if r.path_pattern else {})}
    params = [{"name": r.path_param, "in": "path", "required": True, "schema": schema}] if r.path_param else []
    params += [{"name": n, "in": "query", "required": False, "schema": s} for n, s in r.query]
    if params:
        op["parameters"] = params
    if r.request:
        refs = [{"$ref": REF.format(name=m.__name__)} for m in r.request]
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": refs[0] if len(refs) == 1 else {"oneOf": refs}}}}
    content: dict[str, Any] = {}
    if r.response is not None:
        content["application/json"] = {"schema": {"$ref": REF.format(name=r.response.__name__)}}
    if r.sse is not None:  # each event: a chunk, or an error after the first token, then [DONE]
        chunk = {"anyOf": [{"$ref": REF.format(name=r.sse.__name__)}, {"$ref": REF.format(name="ErrorResponse")}]}
        data = {"anyOf": [{"const": "[DONE]"},
                          {"type": "string", "contentMediaType": "application/json", "contentSchema": chunk}]}
        content["text/event-stream"] = {"schema": {"type": "object", "properties": {"data": data},
                                                   "required": ["data"],
                                                   "description": "SSE: `data: {chunk}` events, then `data: [DONE]`"}}
    if r.text is not None:
        content[r.text] = {"schema": {"type": "object"} if r.text == "application/json" else {"type": "string"}}
    ok = {"description": "success", "content": content}
    error = {"description": "an OpenAI error body (docs/errors.md)",
             "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}}
    op["responses"] = {str(r.status): ok, "default": error}
    if r.path == "/health":  # not ready: 503 with the same body and its reasons
        op["responses"]["503"] = ok
    if r.open:
        op["security"] = []
    return op


@lru_cache(maxsize=4)
def openapi_document(version: str = "unknown", served_model: str = "kairos-emulated",
                     api_keys: bool = True, vocab_size: int | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of an ingress of Kairos ``version`` serving ``served_model`` (module
    docstring). With ``api_keys`` (the ingress has keys) every operation but those of :data:`ROUTES`
    marked ``open`` needs ``Authorization: Bearer <key>`` (docs/security.md); without, the document
    declares no security. With ``vocab_size`` (the served tokenizer's) token ids are below it. Cached:
    build a copy to change it."""
    _, components = msgspec.json.schema_components(_models(), ref_template=REF)
    _served(components, served_model)
    if vocab_size is not None:
        _vocabulary(components, vocab_size)
    paths: dict[str, dict[str, Any]] = {}
    for r in ROUTES:
        paths.setdefault(r.path, {})[r.method] = _operation(r)
    doc: dict[str, Any] = {"openapi": OPENAPI_VERSION,
                           "info": {"title": "Kairos ingress", "version": version,
                                    "description": "OpenAI's API as vLLM 0.32 serves it, routed over prefill/decode-"
                                                   "disaggregated engines (docs/api.md)"},
                           "paths": paths,
                           "components": {"schemas": components}}
    if api_keys:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"apiKey": []}]
    return doc
