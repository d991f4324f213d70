"""Typed messages on the bus: publish, request-reply, and KV writes without a round trip.

Bodies are the frozen msgspec structs of :mod:`kairos.contracts.wire` (``encode``/``decode``; a reply
that does not decode raises :class:`kairos.contracts.wire.WireError` naming the field). Subjects come
from :mod:`kairos.contracts.subjects`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar

import msgspec
from nats.aio.client import Client
from nats.js.api import Header

from kairos.contracts import subjects as S
from kairos.contracts.wire import WireError, decode, encode

T = TypeVar("T")


async def request_typed(nc: Client, subject: str, msg: msgspec.Struct, reply_type: type[T], timeout: float,
                        headers: dict[str, str] | None = None) -> T:
    """Request-reply with typed bodies.

    Raises:
        nats.errors.NoRespondersError: nobody subscribes to ``subject`` (node gone).
        nats.errors.TimeoutError: no reply within ``timeout`` s (node hung or overloaded).
        kairos.contracts.wire.WireError: the reply does not decode.
    """
    reply = await nc.request(subject, encode(msg), timeout=timeout, headers=headers)
    return decode(reply.data, reply_type)


def decoded(data: bytes, typ: type[T], log: Any, event: str, level: str = "warning", **fields: Any) -> T | None:
    """``decode(data, typ)``, or None after logging ``event`` (at ``level``, with the decoder's message
    naming the field and ``fields``): a subscription callback drops a malformed message instead of
    raising into nats-py's error callback."""
    try:
        return decode(data, typ)
    except WireError as exc:
        getattr(log, level)(event, error=str(exc), **fields)
        return None


async def publish(nc: Client, subject: str, msg: msgspec.Struct, headers: dict[str, str] | None = None) -> None:
    """Core-NATS publish of a typed message."""
    await nc.publish(subject, encode(msg), headers=headers)


def kv_subject(bucket: str, key: str) -> str:
    """The subject a write of KV ``bucket``/``key`` is published on (nats-py ``nats/js/kv.py``)."""
    return f"$KV.{bucket}.{key}"


async def kv_put_ttl(nc: Client, bucket: str, key: str, value: bytes, msg_ttl_s: int, timeout_s: float) -> int:
    """``KeyValue.put`` with a per-message TTL (``msg_ttl_s`` seconds; nats-py's ``put`` takes none,
    only ``create`` does): an acknowledged JetStream publish to :func:`kv_subject`. Returns the new
    revision. Raises ``nats.errors.TimeoutError`` (no acknowledgement within ``timeout_s``) or
    ``nats.js.errors.APIError`` (refused)."""
    ack = await nc.jetstream().publish(kv_subject(bucket, key), value, msg_ttl=msg_ttl_s, timeout=timeout_s)
    return ack.seq


async def kv_put_nowait(nc: Client, bucket: str, key: str, value: bytes, msg_ttl_s: int | None = None,
                        if_absent: bool = False) -> None:
    """Write KV ``bucket``/``key`` without asking for the server's acknowledgement: a core-NATS
    publish to ``$KV.<bucket>.<key>``, which the bucket's stream stores exactly as ``KeyValue.put``'s
    JetStream publish would (nats-py ``nats/js/kv.py``), with ``Nats-TTL`` for ``msg_ttl_s``
    (seconds; the bucket must allow per-message TTLs). ``if_absent``: the stream stores it only if
    the key holds nothing yet (``Nats-Expected-Last-Subject-Sequence: 0``; else silently dropped).

    One message instead of a request and its acknowledgement, and no round trip: the caller goes
    on at once (issue 12, item 5). Writes of one connection reach the stream in the order they were
    made, so a later :func:`kv_delete_nowait` of the key never overtakes this. What is lost: the
    caller does not learn of a failure (the bus down, a full store); a permission violation reaches
    the connection's error callback (logged as ``nats_error``). For writes that are only
    advisory or records — never for anything that decides who runs a request.
    """
    headers = {Header.MSG_TTL: str(int(msg_ttl_s))} if msg_ttl_s else {}
    if if_absent:  # stored only while the key has no value yet (JetStream's expected last subject sequence 0)
        headers[Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value] = "0"
    await nc.publish(kv_subject(bucket, key), value, headers=headers or None)


async def kv_delete_nowait(nc: Client, bucket: str, key: str) -> None:
    """Delete KV ``bucket``/``key`` (a delete marker, as ``KeyValue.delete``) without asking for
    the server's acknowledgement; ordered after this connection's earlier writes of the key
    (:func:`kv_put_nowait` has the trade-off)."""
    await nc.publish(kv_subject(bucket, key), b"", headers={"KV-Operation": "DEL"})


#: how long a service that starts (or reconnected) waits for the view bucket's last view (s): the
#: bucket's leader may be electing; the next view on ``kairos.view`` comes within a period anyway
LAST_VIEW_TIMEOUT_S = 2.0


async def last_view(bucket: Any, take: Callable[[bytes], None], log: Any,
                    timeout_s: float = LAST_VIEW_TIMEOUT_S) -> None:
    """Read the view bucket's last view once (``bucket``: the ``kairos_view`` KV handle) and hand its
    bytes to ``take``: what a dispatcher or the ingress knows of the cluster until the first view on
    ``kairos.view`` comes. Views reach the services on that subject only; the aggregator writes the
    bucket at most once a second for this read (issue 34: each view used to be received twice,
    from the subject and from a watch on the bucket). Never raises (no view yet, or no answer: logged
    at debug; the subject's next view follows)."""
    try:
        e = await asyncio.wait_for(bucket.get(S.VIEW_KEY), timeout_s)
    except Exception as exc:  # no view stored yet, or the bucket does not answer now
        log.debug("last_view_unread", error=repr(exc))
        return
    if e is not None and e.value:
        take(e.value)
