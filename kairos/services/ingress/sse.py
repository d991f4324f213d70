"""Server-sent events to the client: the stream response, one event's bytes, writes that tell a gone client.

The relay (:mod:`.relay`) opens the stream at the first token (an error before it still gets a
proper HTTP status), writes each burst of chunks in one write, and ends with the last chunks,
``data: [DONE]`` and the chunked-encoding end in one write. A write to a client that closed its
connection returns False (never raises): the relay then cancels the request on the nodes.
"""

from __future__ import annotations

import orjson
from aiohttp import web

#: what aiohttp raises when writing to a connection the client closed
GONE = (ConnectionResetError, RuntimeError)


class SseResponse(web.StreamResponse):
    """An SSE response whose status line and headers go out with its first event (one write, not
    two). ``_send_headers_immediately`` is aiohttp's (3.14, web_response.py; ``web.Response`` sets
    it False the same way); without it aiohttp sends the headers at ``prepare()``, which is correct too."""

    _send_headers_immediately = False


def sse_event(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON (``data: {…}`` and the blank line)."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def sse_write(resp: web.StreamResponse, data: bytes) -> bool:
    """Write SSE bytes (one or more events); False if the client is gone."""
    try:
        await resp.write(data)
        return True
    except GONE:
        return False


async def sse_done(resp: web.StreamResponse, *last: dict, before: bytes = b"") -> bool:
    """End the stream: ``before`` (events relayed but not written yet), the ``last`` events,
    ``data: [DONE]`` and the chunked-encoding end in one write (one syscall instead of several).
    False if the client is gone (nothing more to do: the request has ended)."""
    try:
        await resp.write_eof(before + b"".join(sse_event(o) for o in last) + b"data: [DONE]\n\n")
        return True
    except GONE:
        return False
