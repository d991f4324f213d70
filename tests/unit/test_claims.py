"""The ingress's tombstones (kairos/runtime/claims.py): an attempt it refused is withdrawn by creating its
execution claim first, so that no node ever runs it — against one in-memory claim bucket that
behaves as nats-py's KeyValue does (tests/unit/fake_kv.py), on a clock the test moves (a single
nats-server; the majority over several buckets: tests/unit/test_claim_quorum.py)."""

from __future__ import annotations

import asyncio
import types

import nats.errors
import nats.js.errors
import pytest

from kairos.runtime import claims
from kairos.contracts import subjects as S
from kairos.runtime.claims import BUCKET_TIMEOUT_S, ClaimQuorum, tombstone, withdraw
from kairos.contracts.wire import Claim, decode, encode
from tests.unit.fake_kv import FakeKV

T0 = 1_700_000_000_000.0  #: the test clock's start, wall-clock ms


class Clock:
    """``now_ms`` of kairos.runtime.claims and the ``asyncio`` it waits with: a sleep moves the clock on at
    once; every wait for the bus and every sleep is recorded (seconds)."""

    def __init__(self) -> None:
        self.ms = T0
        self.waits: list[float] = []
        self.sleeps: list[float] = []

    def now_ms(self) -> float:
        return self.ms

    async def wait_for(self, aw, timeout):
        self.waits.append(timeout)
        return await aw

    async def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.ms += s * 1000.0


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(claims, "now_ms", c.now_ms)
    monkeypatch.setattr(claims, "asyncio", types.SimpleNamespace(wait_for=c.wait_for, sleep=c.sleep,
                                                                    gather=asyncio.gather,
                                                                    TimeoutError=asyncio.TimeoutError))
    return c


KEY = S.claim_key("cmpl-1")


def test_a_tombstone_names_no_node_and_the_code_the_attempt_was_answered_with(clock):
    assert tombstone("enqueue_failed") == Claim(node="", kind="keep", withdrawn="enqueue_failed",
                                                claimed_unix_ms=T0)
    with pytest.raises(ValueError, match="^a tombstone needs the error code the attempt was answered with$"):
        tombstone("")


async def test_withdrawing_a_free_attempt_stores_its_tombstone(clock):
    kv = FakeKV()
    outcome, held = await withdraw(ClaimQuorum(kv), "cmpl-1", "enqueue_failed", T0 + 5_000)
    want = Claim(node="", kind="keep", withdrawn="enqueue_failed", claimed_unix_ms=T0)
    assert (outcome, held) == ("withdrawn", want)
    assert decode(kv.value(KEY), Claim) == want
    assert kv.calls == [("create", KEY)] and clock.waits == [BUCKET_TIMEOUT_S] and clock.sleeps == []  # one try, bounded


async def test_a_nodes_claim_made_first_is_reported_and_kept(clock):
    kv = FakeKV()
    ran = Claim(node="prefill-1", kind="keep", decode_node="decode-0", claimed_unix_ms=T0 - 10)
    kv.put_raw(KEY, encode(ran))
    assert await withdraw(ClaimQuorum(kv), "cmpl-1", "enqueue_failed", T0 + 5_000) == ("ran", ran)
    assert decode(kv.value(KEY), Claim) == ran  # not overwritten
    assert kv.calls == [("create", KEY), ("get", KEY)] and clock.waits == [BUCKET_TIMEOUT_S] * 2


async def test_an_earlier_tombstone_counts_as_withdrawn(clock):
    kv = FakeKV()
    earlier = Claim(node="", kind="keep", withdrawn="no_available_node", claimed_unix_ms=T0 - 10)
    kv.put_raw(KEY, encode(earlier))
    assert await withdraw(ClaimQuorum(kv), "cmpl-1", "enqueue_failed", T0 + 5_000) == ("withdrawn", earlier)


async def test_bus_errors_are_retried_every_quarter_second_until_the_tombstone_is_stored(clock):
    kv = FakeKV()
    kv.faults["create"] += [nats.errors.TimeoutError(), nats.errors.NoRespondersError()]
    outcome, held = await withdraw(ClaimQuorum(kv), "cmpl-1", "enqueue_failed", T0 + 5_000)
    # third try at T0 + 2 × 250 ms: the tombstone carries the clock of the withdrawal's start (T0)
    assert outcome == "withdrawn" and held.claimed_unix_ms == T0 and decode(kv.value(KEY), Claim) == held
    # the timed-out create is read back (it may be stored): nothing there, so it is tried again
    assert kv.calls == [("create", KEY), ("get", KEY), ("create", KEY), ("create", KEY)]
    assert clock.sleeps == [0.25, 0.25] and clock.waits == [BUCKET_TIMEOUT_S] * 4


@pytest.mark.parametrize("trouble", ["released", "unreadable", "garbled", "empty"])
async def test_a_held_claim_that_cannot_be_read_is_tried_again(clock, trouble):
    # the create finds the key held, but the read gets no claim: the holder released it meanwhile
    # (compare-and-delete), the read timed out, or the value is not a claim: try again from the create
    kv = FakeKV()
    ran = Claim(node="prefill-1", kind="keep", claimed_unix_ms=T0 - 10)
    if trouble == "released":
        kv.put_raw(KEY, encode(ran))
        kv.faults["get"].append(lambda: kv.entries.pop(KEY))  # gone between the create and the read
    elif trouble == "unreadable":
        kv.put_raw(KEY, encode(ran))
        kv.faults["get"].append(nats.errors.TimeoutError())
    else:
        kv.put_raw(KEY, b'{"node": 7}' if trouble == "garbled" else b"")
        kv.faults["create"] += [lambda: None, lambda: kv.put_raw(KEY, encode(ran))]  # a node claims it then
    outcome, held = await withdraw(ClaimQuorum(kv), "cmpl-1", "enqueue_failed", T0 + 5_000)
    if trouble == "released":  # the second create stores the tombstone
        assert outcome == "withdrawn" and held.withdrawn == "enqueue_failed"
        assert kv.calls == [("create", KEY), ("get", KEY), ("create", KEY)]
    else:  # the second read finds the node's claim
        assert (outcome, held) == ("ran", ran)
        assert kv.calls == [("create", KEY), ("get", KEY)] * 2
    assert clock.sleeps == [0.25]


async def test_a_bus_that_never_answers_expires_at_the_deadline(clock):
    kv = FakeKV()
    kv.faults["create"] += [nats.errors.TimeoutError()] * 10
    assert await withdraw(ClaimQuorum(kv), "cmpl-1", "enqueue_failed", T0 + 1_000) == ("expired", None)
    # tries at T0 + 0, 250, 500, 750 ms; at T0 + 1000 the deadline has come: no fifth
    assert kv.calls == [("create", KEY), ("get", KEY)] * 4 and clock.sleeps == [0.25] * 4
    assert kv.value(KEY) is None


async def test_retry_and_timeout_are_the_callers(clock):
    kv = FakeKV()
    kv.faults["create"] += [nats.errors.TimeoutError()] * 10
    assert await withdraw(ClaimQuorum(kv, timeout_s=0.1), "cmpl-1", "x", T0 + 1_000, retry_s=0.4) == ("expired", None)
    assert clock.sleeps == [0.4] * 3 and clock.waits == [0.1] * 6  # tries at T0 + 0, 400, 800 ms: create + read


async def test_nothing_is_tried_once_the_deadline_has_come(clock):
    kv = FakeKV()
    assert await withdraw(ClaimQuorum(kv), "cmpl-1", "enqueue_failed", T0) == ("expired", None)  # now == deadline: too late
    assert kv.calls == []


@pytest.mark.parametrize("error", [nats.js.errors.KeyWrongLastSequenceError(description="wrong last sequence: 3"),
                                   nats.js.errors.KeyNotFoundError(), nats.js.errors.KeyDeletedError()])
async def test_release_never_raises_on_an_api_error_that_carries_no_err_code(clock, error):
    """``release`` is documented never to raise. nats-py's KV errors are ``APIError``s, and three of
    them set no ``err_code`` attribute in their ``__init__`` (``nats/js/errors.py``): reading it
    without a default would raise ``AttributeError`` out of the release. Such a bucket is tried again
    (its answer names no revision to give up on), then left."""
    kv = FakeKV()
    assert not hasattr(error, "err_code")
    rev = kv.put_raw(KEY, b"claim")
    kv.faults["delete"] += [error, error, error]
    await ClaimQuorum(kv).release(KEY, [rev])
    assert kv.calls == [("delete", KEY)] * 3 and kv.value(KEY) == b"claim"
