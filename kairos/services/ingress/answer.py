"""What the client of one request gets: an SSE stream opened at its first token, or one JSON body.

The relay (:mod:`.relay`) decides; :class:`ClientAnswer` writes. A streaming request's HTTP headers
go out only with its first token (so an error before it still gets a proper 4xx/5xx status), each
burst of chunks in one write, and the end — the last chunks, ``data: [DONE]`` and the
chunked-encoding end — in one more; chat streams send the role alone first, as OpenAI and vLLM do,
and the finish reason rides on the last token's chunk, as vLLM's does (:meth:`ClientAnswer.complete`).
An error after the first token is an SSE error event. A non-streaming request's text is kept
until its end. Bodies are OpenAI's (:mod:`.openai_api.responses`).
"""

from __future__ import annotations

from typing import Callable

import orjson
from aiohttp import web

from kairos.contracts.errors import ErrorCode, error_type_for
from kairos.contracts.events import TokenEvent
from kairos.services.ingress.http import STREAM_STARTED, clip, error_response
from kairos.services.ingress.openai_api.params import ParsedRequest
from kairos.services.ingress.openai_api.responses import (choice_logprobs, error_body, full_response, stream_chunk,
                                                          usage_chunk)
from kairos.services.ingress.sse import GONE, SseResponse, sse_done, sse_event, sse_write

#: what a relay returns: the response sent (or to send) and its HTTP status (499: the client left)
Outcome = tuple[web.StreamResponse, int]


class ClientAnswer:
    """The answer to one request (module docstring).

    Args:
        request: the client's HTTP request (the stream is prepared on it).
        parsed: its validated body (endpoint, stream, include_usage, model).
        rid, created: the ``id`` the client sees (:class:`~.request_ids.RequestIds` ``response``), its
            ``created`` (unix s).
        headers: the response headers naming the request (``X-Request-Id``, ``X-Kairos-Request-Id``,
            ``X-Trace-Id``).
        on_commit: called when the stream opens (something reached the client: no re-submission).
    """

    def __init__(self, request: web.Request, parsed: ParsedRequest, rid: str, created: int, headers: dict[str, str],
                 on_commit: Callable[[], None]) -> None:
        self.request, self.parsed, self.rid, self.created, self.headers = request, parsed, rid, created, headers
        self.on_commit = on_commit
        self.resp: web.StreamResponse | None = None  #: the SSE stream, once opened
        self.sent = 0  #: tokens delivered to the client (streaming)
        #: SSE chunks relayed but not written yet, and their tokens: written when no further event is
        #: already waiting (one socket write per burst; never held back while the queue is empty)
        self.unsent: list[bytes] = []
        self.unsent_tokens = 0
        #: a chunk with the finish reason was relayed (the token event said it was the last)
        self.finish_relayed = False
        #: (text, echo, logprobs) of the last token chunk while it is the last of :attr:`unsent`, so
        #: the end can still put the finish reason on it
        self.last_unsent: tuple[str, bool, dict | None] | None = None
        self.text_parts: list[str] = []  #: the answer so far (non-streaming)
        self.logprobs: list = []  #: the tokens' logprobs so far (non-streaming, when asked for)
        self.text_offset = 0  #: completions stream: where the next chunk's first token starts (``text_offset``)

    async def tokens(self, tok: TokenEvent, first: bool, flush: Callable[[], bool]) -> bool:
        """Relay ``tok`` (``first``: the attempt's first; ``flush()``: no further event waits, so write
        the burst now) as one chunk, with its ``finish_reason`` when it is the last. False when the
        client is gone."""
        parsed = self.parsed
        if not parsed.stream:
            self.text_parts.append(tok.text)
            self.logprobs.extend(tok.logprobs or ())
            return True
        if self.resp is None and not await self._open_stream():
            return False
        if first and parsed.endpoint == "chat":  # the role alone first, as OpenAI and vLLM send it
            self.unsent.append(sse_event(stream_chunk(parsed, self.rid, self.created, "", None, first=True)))
        lp = choice_logprobs(parsed, tok.logprobs, self.text_offset)
        if lp is not None and tok.logprobs:  # vLLM: next_text_offsets = last offset + len(last token)
            self.text_offset += sum(len(e.token) for e in tok.logprobs)
        self.unsent.append(sse_event(stream_chunk(parsed, self.rid, self.created, tok.text, tok.finish_reason,
                                                  echo=first, logprobs=lp, stop_reason=tok.stop_reason)))
        self.finish_relayed = tok.finish_reason is not None
        self.last_unsent = None if self.finish_relayed else (tok.text, first, lp)
        self.unsent_tokens += tok.count
        if flush():
            ok = await sse_write(self.resp, b"".join(self.unsent))
            self.unsent.clear()
            self.last_unsent = None
            if not ok:
                return False
            self.sent += self.unsent_tokens
            self.unsent_tokens = 0
        return True

    async def _open_stream(self) -> bool:
        """Send the SSE headers (with the first token's chunk); False if the client is gone."""
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self.headers}
        self.resp = SseResponse(headers=headers)
        self.request[STREAM_STARTED] = True
        self.on_commit()
        try:
            await self.resp.prepare(self.request)
            return True
        except GONE:  # gone while the headers were written
            return False

    def discard(self) -> int:
        """Forget the text kept so far (the attempt was given up); returns how many token events it had."""
        n = len(self.text_parts)
        self.text_parts.clear()
        self.logprobs.clear()
        return n

    @property
    def delivered(self) -> int:
        """Tokens the client got or is getting with the error now (streaming), 0 otherwise."""
        return self.sent + self.unsent_tokens if self.parsed.stream else 0

    async def complete(self, finish_reason: str, prompt_tokens: int, completion_tokens: int,
                       cached_tokens: int, stop_reason: str | int | None = None) -> Outcome:
        """The end of the stream, or the full response body.

        The stream ends as vLLM's (``completion_stream_generator`` / ``chat_completion_stream_generator``
        in ``vllm/entrypoints/openai/``): the finish reason on the last token's chunk, then the usage
        chunk (``stream_options.include_usage``), then ``data: [DONE]``. The last token event
        normally says it is the last (``TokenEvent.finish_reason``: both backends set it); if it did
        not, the finish reason goes onto its chunk when that is still unwritten, else into one more
        chunk without text (what vLLM sends when its last output has no token). ``stop_reason`` (the
        done event's: the stop string or token id that ended it) goes on the choice of the body, or on
        the chunk this end writes with the finish reason (a marked token event carried its own)."""
        parsed, rid, created = self.parsed, self.rid, self.created
        if not parsed.stream:
            body = full_response(parsed, rid, created, "".join(self.text_parts), finish_reason, prompt_tokens,
                                 completion_tokens, cached_tokens, self.logprobs, stop_reason)
            return web.Response(body=orjson.dumps(body), content_type="application/json", headers=self.headers), 200
        assert self.resp is not None
        last: list[dict] = []
        if self.last_unsent is not None:  # the last token's chunk is not written yet: it carries the finish
            self.unsent.pop()
            text, echo, lp = self.last_unsent
            last.append(stream_chunk(parsed, rid, created, text, finish_reason, echo=echo, logprobs=lp,
                                     stop_reason=stop_reason))
        elif not self.finish_relayed:
            last.append(stream_chunk(parsed, rid, created, None if parsed.endpoint == "chat" else "", finish_reason,
                                     stop_reason=stop_reason))
        if parsed.include_usage:
            last.append(usage_chunk(parsed, rid, created, prompt_tokens, completion_tokens, cached_tokens))
        await sse_done(self.resp, *last, before=b"".join(self.unsent))
        return self.resp, 200

    async def error(self, status: int, code: ErrorCode, message: str) -> Outcome:
        """An OpenAI error body with ``status`` before the first token, else an SSE error event."""
        if self.resp is None:
            return error_response(code, message, status=status), status
        await sse_done(self.resp, error_body(clip(message), error_type_for(status), None, code),
                       before=b"".join(self.unsent))
        return self.resp, status

    def gone(self) -> Outcome:
        """The client left: 499 (nobody reads it; the status is for the log, metrics and record)."""
        if self.resp is None or not self.resp.prepared:
            return error_response(ErrorCode.CLIENT_DISCONNECTED, "client closed the connection"), 499
        return self.resp, 499
