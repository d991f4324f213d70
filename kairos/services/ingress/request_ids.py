"""A completion request's ids: the client's ``X-Request-Id``, the response ``id``, the internal bus id.

vLLM 0.32 (``vllm/entrypoints/serve/engine/serving.py`` ``_base_request_id``) uses a client's
``X-Request-Id`` header as the request's id: the response ``id`` is ``cmpl-<header>`` (completions)
or ``chatcmpl-<header>`` (chat), and its log names it; with ``--enable-request-id-headers`` it also
echoes the header in the response (``vllm/entrypoints/serve/middleware/x_request_id.py``). Kairos
does the same (and always echoes), but two requests with the same header are still two
executions: the id on the bus (subjects, records, node logs) is Kairos' own, unique per
request, and the client's id travels beside it — in the ingress's log lines
(``client_request_id``), its span (``kairos.client_request_id``) and its record
(``GET /v1/requests/{id}``, ``client_request_id``).

=======================  ===================================  =======================================
                         without ``X-Request-Id``             with ``X-Request-Id: abc``
=======================  ===================================  =======================================
response ``id``          ``cmpl-<24 hex>`` (the internal id)  ``cmpl-abc`` / ``chatcmpl-abc``
``X-Request-Id``         the internal id                      ``abc``
``X-Kairos-Request-Id``  the internal id                      the internal id (``cmpl-<24 hex>``)
=======================  ===================================  =======================================

``GET /v1/requests/{id}`` takes the internal id (``X-Kairos-Request-Id``).

The header is checked before anything else of the request is done (vLLM takes any value; Kairos
writes it into logs, spans, records and a response header, so it must be harmless there): 1 to
:data:`MAX_CLIENT_ID_CHARS` characters of :data:`CLIENT_ID_CHARS`, sent once; else 400
``invalid_request_id`` naming the header.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Mapping

from kairos.contracts.errors import ErrorCode
from kairos.services.ingress.openai_api.responses import ApiError

#: the client's request id header (vLLM's)
CLIENT_ID_HEADER = "X-Request-Id"
#: the response header naming Kairos' own id of the request (``GET /v1/requests/{id}``)
KAIROS_ID_HEADER = "X-Kairos-Request-Id"
#: the longest ``X-Request-Id`` accepted (a UUID is 36)
MAX_CLIENT_ID_CHARS = 128
#: the characters an ``X-Request-Id`` may have: letters, digits and ``- _ . : / + = @ ~`` (UUIDs, ULIDs,
#: base64, ``name:123``…; no space, quote, comma, semicolon or control character)
CLIENT_ID_CHARS = "A-Za-z0-9-_.:/+=@~"
_CLIENT_ID_RE = re.compile(r"[A-Za-z0-9._:/+=@~-]{1,%d}" % MAX_CLIENT_ID_CHARS)
#: the prefix of a response id (and of the internal id) per endpoint, as vLLM's
PREFIX = {"completions": "cmpl-", "chat": "chatcmpl-"}


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's ``X-Request-Id`` (None: not sent).

    Args:
        headers: the HTTP request's headers (aiohttp's ``CIMultiDictProxy``: ``getall`` is used).

    Raises:
        ApiError: 400 ``invalid_request_id`` (``param``: the header's name) for a value that is empty,
            longer than :data:`MAX_CLIENT_ID_CHARS`, has a character outside :data:`CLIENT_ID_CHARS`, or
            a header sent more than once.
    """
    values = headers.getall(CLIENT_ID_HEADER, []) if hasattr(headers, "getall") else (
        [headers[CLIENT_ID_HEADER]] if CLIENT_ID_HEADER in headers else [])
    if not values:
        return None
    if len(values) > 1:
        raise ApiError(ErrorCode.INVALID_REQUEST_ID, f"the {CLIENT_ID_HEADER} header was sent {len(values)} times; "
                                                     "send it once", param=CLIENT_ID_HEADER)
    value = values[0]
    if not _CLIENT_ID_RE.fullmatch(value):
        why = (f"has {len(value)} characters (at most {MAX_CLIENT_ID_CHARS})" if len(value) > MAX_CLIENT_ID_CHARS
               else "is empty" if not value.strip() else
               f"may contain only letters, digits and {' '.join('-_.:/+=@~')}")
        raise ApiError(ErrorCode.INVALID_REQUEST_ID, f"the {CLIENT_ID_HEADER} header {why}", param=CLIENT_ID_HEADER)
    return value


@dataclass(frozen=True)
class RequestIds:
    """The ids of one completion request (module docstring).

    ``internal``: Kairos' id, unique per request — the bus id of its first attempt (re-submissions are
    ``<internal>-r<n>``), the key of its records; ``response``: the ``id`` of its response body and
    chunks; ``client``: the client's ``X-Request-Id`` (None: not sent).
    """

    internal: str
    response: str
    client: str | None = None

    @classmethod
    def new(cls, endpoint: str, client: str | None) -> "RequestIds":
        """Fresh ids for a request to ``endpoint`` (``completions``/``chat``) with the client's id ``client``."""
        internal = PREFIX[endpoint] + uuid.uuid4().hex[:24]
        return cls(internal, internal if client is None else PREFIX[endpoint] + client, client)

    def headers(self) -> dict[str, str]:
        """The response headers naming the request: ``X-Request-Id`` (the client's, else the internal
        id) and ``X-Kairos-Request-Id`` (the internal id)."""
        return {CLIENT_ID_HEADER: self.client or self.internal, KAIROS_ID_HEADER: self.internal}
