"""Every error code a client can get from Kairos: one catalogue for the wire, the HTTP layer and the docs.

An error reaches a client as OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``
(with an HTTP status before the first token, or as an SSE ``data: {"error": …}`` after it). The
``code`` is one :class:`ErrorCode`: the ingress's request validation and HTTP hardening use it
directly, and the services that end a request on the bus (dispatcher, node agent) put it in
:class:`kairos.contracts.events.ErrorEvent` ``.code``. Each member carries its HTTP status and one line
of documentation; ``docs/errors.md`` is generated from this table (``python -m tools.docgen``), so the
catalogue cannot drift from the code.

The OpenAI ``type`` follows from the status (:func:`error_type_for`), as in OpenAI's API and vLLM's
server (vllm/entrypoints/openai/protocol.py ``ErrorResponse``): 400 ``invalid_request_error``,
404 ``not_found_error``, 429 ``rate_limit_error``, 503 ``service_unavailable``, other 5xx
``server_error``.

The catalogue itself is data, ``kairos/contracts/error_codes.toml`` (one table per code: status, stage,
doc); adding a code is one table there, then ``python -m tools.docgen``.
Pure: no I/O, standard library only.
"""

from __future__ import annotations

import enum
import json
import tomllib
from importlib import resources


class _ErrorCodeBase(enum.StrEnum):
    """An error code, its HTTP status and its documentation line (members: :data:`ErrorCode`).

    The member's value is the wire/JSON string (``ErrorCode.NODE_LOST == "node_lost"``), so it
    encodes unchanged with msgspec/orjson and compares equal to the string a v1 producer sent.

    Attributes:
        status: the HTTP status a client gets with this code before its first token.
        stage: ``validation`` (the ingress refused the request before queueing it) or ``serving``
            (an accepted request ended: the ingress, a dispatcher or a node agent).
        doc: one line for docs/errors.md: when the code is sent.
        retry: True when the same request may succeed if sent again (the 503s and 429 carry
            ``Retry-After``).
    """

    status: int
    stage: str
    doc: str
    retry: bool


def _load_catalogue() -> type[_ErrorCodeBase]:
    """Read ``error_codes.toml`` (beside this module) into the :data:`ErrorCode` enum.

    Raises:
        ValueError: an entry without an integer ``status`` in 400..599 or a string ``doc``.
    """
    table = tomllib.loads(resources.files(__package__).joinpath("error_codes.toml").read_text(encoding="utf-8"))
    codes = _ErrorCodeBase("ErrorCode", [(name.upper(), name) for name in table], module=__name__,
                           qualname="ErrorCode")
    for member in codes:
        entry = table[member.value]
        status, stage, doc = entry.get("status"), entry.get("stage"), entry.get("doc")
        if not (isinstance(status, int) and 400 <= status <= 599 and isinstance(doc, str) and doc
                and stage in ("validation", "serving")):
            raise ValueError(f"error_codes.toml: [{member.value}] needs status (400..599), stage "
                             f"(validation | serving) and doc")
        member.status, member.stage, member.doc, member.retry = status, stage, doc, status in (429, 503)
    return codes


#: every error code (``ErrorCode.NODE_LOST``, ``ErrorCode("node_lost")``), from ``error_codes.toml``
ErrorCode = _load_catalogue()


def error_message(body: bytes, fallback: str) -> str:
    """The ``error.message`` of an OpenAI error ``body`` (what a client of the ingress shows), or
    ``fallback`` (the HTTP reason) when the body is not one."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return fallback
    return message if isinstance(message, str) else fallback


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
    400: ErrorCode.BAD_REQUEST, 408: ErrorCode.REQUEST_TIMEOUT, 413: ErrorCode.REQUEST_TOO_LARGE,
    500: ErrorCode.INTERNAL_ERROR, 504: ErrorCode.TIMEOUT,
}
