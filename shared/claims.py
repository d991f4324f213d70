"""Tombstones: the ingress withdraws an attempt it refused, so that no node ever executes it.

Why (a race seen in CI, tests/faults/test_nats_restart.py): when the ingress's JetStream publish
of a request times out (nats-server paused or slow) it answers 503 ``enqueue_failed`` ("retry"),
but the publish may still be stored when the server resumes. Its ``Cancel`` follows on the same
connection, yet nats-py runs each subscription's callbacks in a task of its own, so a dispatcher
and a node agent can handle the stored request *before* their cancel callbacks run: the node
accepted (``job_accepted``) a request whose client had already been told to retry.

The order-independent fix: the ingress also creates the attempt's execution claim
(:func:`shared.subjects.claim_key`, KV ``create``) as a tombstone (:class:`~shared.wire.Claim`
with ``withdrawn`` set and no node). Every node agent claims a request before its engine gets it
(services/node_agent/acceptance.py), finds the tombstone and refuses the job as ``cancelled``,
whatever order the request, the cancel and the job reach it in. The tombstone's create follows
the request and the cancel on the ingress's connection, and a node's claim can only be made
after a dispatcher pulled the stored request, so the tombstone is stored first; if a node's claim
is there first all the same (the request was stored and routed before the ingress gave up), the
ingress logs ``withdrawn_attempt_ran`` with that node (the client was told to retry: it may run
twice, as before this fix).
"""

from __future__ import annotations

import asyncio
from typing import Literal

import nats.js.errors
from nats.js.kv import KeyValue

from shared import subjects as S
from shared.wire import Claim, WireError, decode, encode, now_ms

Withdrawal = Literal["withdrawn", "ran", "expired"]


def tombstone(code: str) -> Claim:
    """The tombstone claim of an attempt the ingress answered with error ``code``."""
    if not code:
        raise ValueError("a tombstone needs the error code the attempt was answered with")
    return Claim(node="", kind="prefill", withdrawn=code, claimed_unix_ms=now_ms())


async def withdraw(kv: KeyValue, request_id: str, code: str, until_unix_ms: float,
                   retry_s: float = 0.25, timeout_s: float = 2.0) -> tuple[Withdrawal, Claim | None]:
    """Create the tombstone of attempt ``request_id`` in the requests bucket ``kv``, retried every
    ``retry_s`` (each try waits ``timeout_s`` for the bus) until the bus answers or the wall clock
    passes ``until_unix_ms`` (the attempt's deadline: after it no dispatcher routes the request and
    no node accepts it, services/node_agent: ``deadline_passed``).

    Returns:
        ``("withdrawn", tombstone)`` once the tombstone is stored (or already was), ``("ran",
        claim)`` when a node's claim was there first (``claim``: that node), ``("expired", None)``
        when the bus never answered before ``until_unix_ms``.

    Raises:
        SubjectError: ``request_id`` is not a subject token. Bus errors are retried, never raised.
    """
    key, value = S.claim_key(request_id), tombstone(code)
    while now_ms() < until_unix_ms:
        try:
            await asyncio.wait_for(kv.create(key, encode(value)), timeout_s)
            return "withdrawn", value
        except nats.js.errors.KeyWrongLastSequenceError:
            try:
                e = await asyncio.wait_for(kv.get(key), timeout_s)
                held = decode(e.value, Claim)
            except (nats.js.errors.KeyNotFoundError, WireError):  # WireError: not a claim (or empty)
                held = None  # released (compare-and-delete) meanwhile: create again
            except Exception:
                held = None
            if held is not None:
                return ("withdrawn" if held.withdrawn else "ran"), held
        except Exception:  # timeout, no responders, disconnected: the bus has not answered yet
            pass
        await asyncio.sleep(retry_s)
    return "expired", None
