"""Execution claims over a majority of three claim buckets (kairos/runtime/claims.py, one bucket per NATS
member), each an in-memory bucket that behaves as nats-py's KeyValue does (tests/unit/fake_kv.py):
a claim holds with two of three buckets, one bucket down changes nothing, two down refuse; a
claimant without a majority gives back what it took; and, checked against the buckets' final
contents (not against the claimants' own answers), no two claimants ever both run a request,
whatever buckets fail and however the claimants interleave."""

from __future__ import annotations

import asyncio
import random

import nats.errors
import pytest

from kairos.services.node_agent import acceptance
from kairos.services.node_agent.acceptance import Claims
from kairos.runtime import claims as C
from kairos.contracts import subjects as S
from kairos.runtime.claims import ClaimQuorum, decide, withdraw
from kairos.contracts.wire import Claim, InferenceRequest, Job, decode, encode
from tests.unit.fake_kv import FakeKV

NOW = 1_700_000_000_000.0
EPOCH = NOW - 60_000.0
KEY = S.claim_key("req-1")


@pytest.fixture(autouse=True)
def clock(monkeypatch):
    monkeypatch.setattr(acceptance, "now_ms", lambda: NOW)
    monkeypatch.setattr(C, "now_ms", lambda: NOW)


def job(node: str) -> Job:
    req = InferenceRequest(request_id="req-1", model="m", prompt_tokens=8, max_tokens=2, created_unix_ms=NOW,
                           deadline_unix_ms=NOW + 60_000)
    return Job(kind="keep", request=req, node=node, decode_candidates=["decode-0"])


def buckets(n: int = 3) -> list[FakeKV]:
    return [FakeKV(S.claims_bucket(i)) for i in range(n)]


def holders(kvs: list[FakeKV]) -> list[Claim | None]:
    return [decode(v, Claim) if (v := kv.value(KEY)) else None for kv in kvs]


def other(node: str = "prefill-1", age_ms: float = 10.0) -> Claim:
    return Claim(node=node, kind="keep", claimed_unix_ms=NOW - age_ms)


async def test_a_free_request_is_won_in_every_bucket():
    kvs = buckets()
    res = await Claims(kvs, "prefill-0", EPOCH).claim(job("prefill-0"))
    assert res.outcome == "won" and res.revisions == (1, 1, 1)
    assert [c.node for c in holders(kvs)] == ["prefill-0"] * 3


async def test_one_bucket_down_still_makes_a_majority():
    kvs = buckets()
    kvs[1].faults["create"].append(nats.errors.NoRespondersError())
    res = await Claims(kvs, "prefill-0", EPOCH).claim(job("prefill-0"))
    assert res.outcome == "won" and res.revisions == (1, None, 1)


async def test_two_buckets_down_refuse_and_give_back_the_one_taken():
    kvs = buckets()
    for kv in kvs[1:]:
        kv.faults["create"].append(nats.errors.TimeoutError())
    q = ClaimQuorum(kvs)
    res = await Claims(q, "prefill-0", EPOCH).claim(job("prefill-0"))
    assert res.outcome == "failed" and "1 of 3 claim buckets answered" in res.error
    await q.settled()
    assert holders(kvs) == [None] * 3  # bucket 0's create was released (compare-and-delete)
    assert ("delete", KEY) in kvs[0].calls


async def test_another_nodes_majority_is_claimed_and_this_nodes_one_bucket_released():
    kvs = buckets()
    theirs = other()
    for kv in kvs[:2]:
        kv.put_raw(KEY, encode(theirs))
    q = ClaimQuorum(kvs)
    res = await Claims(q, "prefill-0", EPOCH).claim(job("prefill-0"))
    assert (res.outcome, res.claim) == ("claimed", theirs)
    await q.settled()
    assert holders(kvs) == [theirs, theirs, None]


@pytest.mark.parametrize("age_ms, outcome", [(10.0, "failed"), (C.SETTLED_AFTER_MS, "claimed")])
async def test_a_claim_seen_once_with_its_other_bucket_down_counts_only_once_settled(age_ms, outcome):
    # bucket 0 holds another node's claim, bucket 2 is down (it may hold that claim too), this node
    # takes bucket 1: young, the other claim may be a loser about to release; settled, it won
    kvs = buckets()
    theirs = other(age_ms=age_ms)
    kvs[0].put_raw(KEY, encode(theirs))
    kvs[2].faults["create"].append(nats.errors.NoRespondersError())
    q = ClaimQuorum(kvs)
    res = await Claims(q, "prefill-0", EPOCH).claim(job("prefill-0"))
    assert res.outcome == outcome and (res.claim == theirs) == (outcome == "claimed")
    await q.settled()
    assert holders(kvs) == [theirs, None, None]  # bucket 1 given back either way


async def test_this_incarnations_claim_in_a_majority_is_mine():
    kvs = buckets()
    own = Claim(node="prefill-0", kind="keep", claimed_unix_ms=EPOCH + 5)
    for kv in (kvs[0], kvs[2]):
        kv.put_raw(KEY, encode(own))
    res = await Claims(kvs, "prefill-0", EPOCH).claim(job("prefill-0"))  # bucket 1 is free: taken too
    assert (res.outcome, res.claim, res.revisions) == ("mine", own, (1, 1, 1))


async def test_a_tombstone_in_one_bucket_withdraws_a_claimant_without_a_majority():
    kvs = buckets()
    kvs[0].put_raw(KEY, encode(C.tombstone("enqueue_failed")))
    kvs[1].faults["create"].append(nats.errors.TimeoutError())
    q = ClaimQuorum(kvs)
    res = await Claims(q, "prefill-0", EPOCH).claim(job("prefill-0"))
    assert res.outcome == "withdrawn" and res.claim.withdrawn == "enqueue_failed"
    await q.settled()
    assert holders(kvs)[2] is None  # what it took is given back


async def test_a_node_majority_before_the_tombstone_ran_and_the_ingress_says_so():
    kvs = buckets()
    res = await Claims(kvs[1:], "prefill-0", EPOCH).claim(job("prefill-0"))  # buckets 1, 2 (bucket 0 was down)
    assert res.outcome == "won"
    q = ClaimQuorum(kvs)
    outcome, held = await withdraw(q, "req-1", "enqueue_failed", NOW + 1)
    assert outcome == "ran" and held.node == "prefill-0"


def test_decide_needs_at_least_one_bucket():
    with pytest.raises(ValueError, match="at least one bucket"):
        decide([], mine=lambda c: False)


@pytest.mark.parametrize("seed", range(200))
async def test_no_two_claimants_ever_both_run_a_request(seed):
    """Three nodes claim one request at once over three buckets; each bucket operation may fail
    (no answer) at random, and the claimants interleave at every await. Truth from the buckets
    themselves: at most one claimant says ``won``, and only one whose claim ended in a majority."""
    rnd = random.Random(seed)
    kvs = buckets()
    for kv in kvs:
        for op in ("create", "get"):
            for _ in range(3):
                kv.faults[op].append((lambda: None) if rnd.random() < 0.7 else nats.errors.TimeoutError())

    q = ClaimQuorum(kvs)

    async def claimant(node: str):
        for _ in range(rnd.randrange(3)):
            await asyncio.sleep(0)
        return node, await Claims(q, node, EPOCH).claim(job(node))

    results = await asyncio.gather(*(claimant(f"prefill-{i}") for i in range(3)))
    await q.settled()  # the losers' releases run in tasks of their own
    winners = [node for node, r in results if r.outcome in ("won", "mine")]
    assert len(winners) <= 1, results
    final = [c.node if c else None for c in holders(kvs)]
    for node in winners:
        assert final.count(node) >= 2, (final, results)
    # a claimant that did not win holds no bucket: a later claimant is not refused for nothing
    for node, r in results:
        if node not in winners:
            assert node not in final, (final, results)


async def test_one_nodes_claim_stored_as_two_values_is_still_its_majority():
    # an earlier try of prefill-1 left its claim in bucket 0 (its answer lost), its retry stored another
    # value in bucket 1: the node holds two buckets, whatever the values
    kvs = buckets()
    kvs[0].put_raw(KEY, encode(other(age_ms=900.0)))
    kvs[1].put_raw(KEY, encode(other(age_ms=10.0)))
    res = await Claims(kvs, "prefill-0", EPOCH).claim(job("prefill-0"))
    assert res.outcome == "claimed" and res.claim == other(age_ms=10.0)  # the newest of its values
    assert await C.read_holder(ClaimQuorum(kvs), "req-1") == other(age_ms=10.0)


@pytest.mark.parametrize("n, q", [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_a_majority_is_more_than_half(n, q):
    assert C.quorum_of(n) == q


def test_no_bucket_is_no_quorum():
    with pytest.raises(ValueError, match="^a claim needs at least one bucket$"):
        C.quorum_of(0)
    with pytest.raises(ValueError, match="^a claim needs at least one bucket$"):
        ClaimQuorum([])


def _held(c: Claim) -> C.Vote:
    return C.Vote("held", 1, c)


def test_decided_outcomes_carry_no_error_and_undecided_ones_say_why():
    mine = lambda c: c.node == "me"  # noqa: E731
    me = Claim(node="me", kind="keep", claimed_unix_ms=NOW)
    won = C.Vote("won", 1)
    assert decide([won, won, C.Vote("down", error="e")], mine) == ("won", None, "")
    assert decide([_held(me), won, C.Vote("absent")], mine) == ("mine", me, "")
    tomb = C.tombstone("enqueue_failed")
    assert decide([_held(tomb), won, C.Vote("down", error="e")], mine) == ("withdrawn", tomb, "")
    theirs = other()
    assert decide([_held(theirs), _held(theirs), won], mine) == ("claimed", theirs, "")
    # two buckets, one each: nothing down, a concurrent claimant
    assert decide([won, _held(theirs)], mine) == (
        "failed", None, "2 of 2 claim buckets answered: no majority yet (a concurrent claimant)")
    assert decide([won, C.Vote("down", error="a"), C.Vote("down", error="b")], mine) == (
        "failed", None, "1 of 3 claim buckets answered: a; b")


def test_of_two_other_nodes_the_one_with_more_buckets_holds_it_whatever_is_newer():
    x_old, y_new = other("prefill-1", age_ms=50.0), other("prefill-2", age_ms=5.0)
    votes = [_held(x_old), _held(x_old), _held(y_new)]
    assert decide(votes, lambda c: False) == ("claimed", x_old, "")
    assert C.holder(votes) == x_old
    assert C.holder([C.Vote("absent"), C.Vote("down", error="e")]) is None


async def test_a_timed_out_create_whose_read_finds_another_nodes_claim_is_claimed():
    kv = FakeKV()
    theirs = other()

    def theirs_then_lost():
        kv.put_raw(KEY, encode(theirs))
        raise nats.errors.TimeoutError
    kv.faults["create"].append(theirs_then_lost)
    res = await Claims(kv, "prefill-0", EPOCH).claim(job("prefill-0"))
    assert (res.outcome, res.claim) == ("claimed", theirs)


async def test_mine_names_the_revisions_of_this_nodes_buckets_only():
    kvs = buckets()
    own = Claim(node="prefill-0", kind="keep", claimed_unix_ms=EPOCH + 5)
    kvs[0].put_raw(KEY, encode(own))
    kvs[1].put_raw(KEY, encode(own))
    kvs[2].put_raw(KEY, encode(other()))
    claims = Claims(kvs, "prefill-0", EPOCH)
    res = await claims.claim(job("prefill-0"))
    assert (res.outcome, res.revisions) == ("mine", (1, 1, None))
    await claims.release_mine("req-1")  # gives up its own two, never another node's
    assert holders(kvs) == [None, None, other()]


async def test_release_retries_a_silent_bucket_and_stops_at_a_moved_key(monkeypatch):
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)
    monkeypatch.setattr(C.asyncio, "sleep", sleep)
    kv = FakeKV()
    rev = kv.put_raw(KEY, b"x")
    kv.faults["delete"] += [nats.errors.TimeoutError()] * 5
    await ClaimQuorum(kv).release(KEY, (rev,))
    assert kv.calls == [("delete", KEY)] * 3 and sleeps == [0.2, 0.2] and kv.value(KEY) == b"x"
    moved = FakeKV()
    moved.put_raw(KEY, b"x")
    moved.put_raw(KEY, b"y")  # revision 2: someone else's now
    await ClaimQuorum(moved).release(KEY, (1,))
    assert moved.calls == [("delete", KEY)] and moved.value(KEY) == b"y"  # refused once, not retried


async def test_release_later_starts_nothing_without_a_revision():
    kv = FakeKV()
    q = ClaimQuorum(kv)
    q.release_later(KEY, (None,))
    assert not q._releasing and kv.calls == []
    rev = kv.put_raw(KEY, b"x")
    q.release_later(KEY, (rev,))
    await q.settled()
    assert kv.value(KEY) is None and not q._releasing


async def test_a_bucket_that_never_answers_a_delete_is_given_up_after_its_timeout():
    class Silent:  # a member that takes the request and never answers
        async def delete(self, key: str, last: int | None = None) -> bool:
            await asyncio.Event().wait()
            return True
    await asyncio.wait_for(ClaimQuorum([Silent()], timeout_s=0.01).release(KEY, (1,), retry_s=0.0), 2.0)


async def test_release_mine_tries_each_bucket_once_the_jobs_answer_waits_for_it():
    kv = FakeKV()
    kv.put_raw(KEY, encode(Claim(node="prefill-0", kind="keep", claimed_unix_ms=EPOCH + 5)))
    kv.faults["delete"] += [nats.errors.TimeoutError()] * 3
    await Claims(kv, "prefill-0", EPOCH).release_mine("req-1")
    assert [c for c in kv.calls if c[0] == "delete"] == [("delete", KEY)]
