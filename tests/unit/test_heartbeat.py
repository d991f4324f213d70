"""Heartbeat validation (epoch + seq, future timestamps) and liveness (kairos/core/cluster/heartbeat.py, kairos/services/state_aggregator/view.py)."""

from __future__ import annotations

import msgspec
import pytest

from kairos.core.cluster.heartbeat import HeartbeatGuard, Liveness, accept_heartbeat
from kairos.services.state_aggregator.view import ViewBuilder
from kairos.contracts.wire import NodeState

NOW = 1_700_000_000_000.0
E1 = NOW - 60_000.0  # the agent started a minute ago


def check(g: HeartbeatGuard, seq: int, epoch: float = E1, sent: float = NOW, rx: float = 0.0, now: float = NOW):
    return g.check("decode-0", epoch, seq, sent, 100.0, now, rx)


def test_seq_must_grow_within_an_epoch():
    g = HeartbeatGuard()
    assert check(g, 1) is None
    assert check(g, 2, rx=100) is None
    assert check(g, 2, rx=200) == "replay"
    assert check(g, 1, rx=200) == "replay"
    assert check(g, 3, rx=300) is None


def test_huge_seq_is_refused_and_does_not_lock_out_the_real_node():
    g = HeartbeatGuard(seq_slack=50)
    assert check(g, 10) is None
    assert check(g, 10 ** 12, rx=100) == "seq_jump"
    assert check(g, 11, rx=200) is None  # the real heartbeats keep counting
    # a long silence allows a proportionally larger jump (2 per period): 100 s → 2000 + slack
    assert check(g, 11 + 1500, rx=100_200) is None


def seq10_at_500() -> HeartbeatGuard:
    """A guard whose last accepted heartbeat of E1 (period 100 ms, slack 5) had seq 10, at rx 500 ms."""
    g = HeartbeatGuard(seq_slack=5)
    assert check(g, 10, rx=500) is None
    return g


@pytest.mark.parametrize("rx, seq, want", [
    (1500, 35, None),  # 1000 ms later: 10 + 5 slack + int(2 × 1000 / 100) = 35 allowed
    (1500, 36, "seq_jump"),
    (1549, 35, None),  # 2 × 1049 / 100 = 20.98 → int 20: still 35
    (1549, 36, "seq_jump"),
    (500, 15, None),  # no time elapsed: 10 + 5 slack
    (500, 16, "seq_jump"),
])
def test_the_seq_allowance_is_two_per_period_elapsed_since_the_last_accepted_plus_slack(rx, seq, want):
    assert check(seq10_at_500(), seq, rx=rx) == want


def test_a_declared_period_under_1_ms_counts_as_1_ms():
    g = HeartbeatGuard(seq_slack=5)
    assert g.check("decode-0", E1, 10, NOW, 0.25, NOW, 0.0) is None  # the epoch's first heartbeat declares 0.25 ms
    # 10 ms later: 10 + 5 + int(2 × 10 / max(1, 0.25)) = 35 (not 10 + 5 + 80 = 95)
    assert g.check("decode-0", E1, 36, NOW, 0.25, NOW, 10.0) == "seq_jump"
    assert g.check("decode-0", E1, 35, NOW, 0.25, NOW, 10.0) is None


def test_the_future_limit_is_the_receivers_clock_plus_the_tolerated_skew():
    g = HeartbeatGuard(max_future_ms=5000)
    assert check(g, 1, epoch=NOW + 5000) is None  # exactly NOW + 5000: not beyond it
    assert check(g, 2, epoch=NOW + 5000, sent=NOW + 5000, rx=100) is None
    assert check(g, 3, epoch=NOW + 5000, sent=NOW + 5001, rx=200) == "future"
    g = HeartbeatGuard(max_future_ms=5000)
    assert check(g, 1, epoch=NOW + 5001) == "future"


def test_far_future_timestamps_and_epochs_are_refused():
    g = HeartbeatGuard(max_future_ms=5000)
    assert check(g, 1) is None
    assert check(g, 2, sent=NOW + 3_600_000, rx=100) == "future"
    assert check(g, 1, epoch=NOW + 3_600_000, rx=100) == "future"
    assert check(g, 2, sent=NOW + 4000, rx=100) is None  # within the tolerated skew


def test_restart_new_epoch_accepted_old_epoch_replay_refused():
    g = HeartbeatGuard(stale_after_ms=300)
    assert check(g, 500) is None
    e2 = NOW - 1000.0
    assert check(g, 1, epoch=e2, rx=100) is None  # restarted: seq starts again
    assert check(g, 2, epoch=e2, rx=200) is None
    assert check(g, 501, epoch=E1, rx=250) == "old_epoch"  # the previous incarnation, while the new one lives
    assert check(g, 1, epoch=E1 - 5000, rx=260) == "old_epoch"  # an unknown older incarnation


def test_one_forged_newer_epoch_locks_out_for_at_most_stale_after():
    g = HeartbeatGuard(stale_after_ms=300)
    assert check(g, 10, rx=0) is None
    assert check(g, 1, epoch=NOW + 1000, rx=50) is None  # forged "restart" (within the skew tolerance)
    assert check(g, 11, rx=100) == "old_epoch"  # the real agent looks old...
    assert check(g, 12, rx=350) == "old_epoch"  # 350 − 50 = 300: silent exactly stale_after_ms, not longer
    assert check(g, 12, rx=351) is None  # ...until the forged epoch has been silent for more than that
    # the real epoch is current again: the forged one is now the replay while the real one lives
    assert check(g, 2, epoch=NOW + 1000, rx=360) == "old_epoch"
    assert check(g, 13, rx=400) is None


def test_four_incarnations_are_remembered_the_oldest_forgotten():
    g = HeartbeatGuard(stale_after_ms=300)
    epochs = [E1 + 1000.0 * i for i in range(5)]  # five restarts, each a newer epoch
    for i, e in enumerate(epochs):
        assert check(g, 1, epoch=e, rx=10.0 * i) is None
    # the newest (epochs[4], last heard at rx 40) silent 360 ms > 300: a known older one may take over...
    assert check(g, 2, epoch=epochs[0], rx=400) == "old_epoch"  # ...but the fifth-newest is forgotten
    assert check(g, 2, epoch=epochs[1], rx=400) is None  # the fourth-newest is still known


def test_a_forgotten_node_starts_again():
    g = HeartbeatGuard()
    assert check(g, 5) is None
    g.forget("decode-1")  # another node, and one never seen: nothing happens
    assert check(g, 5, rx=100) == "replay"
    g.forget("decode-0")  # it left the view: its next heartbeat is a first one, whatever its seq
    assert check(g, 1, rx=200) is None
    assert check(g, 1, rx=300) == "replay"


def st(seq: int, epoch: float = E1, sent: float = NOW) -> NodeState:
    return NodeState(node="decode-0", role="decode", seq=seq, sent_unix_ms=sent, epoch_unix_ms=epoch, period_ms=100.0,
                     batch_size=seq)


def test_view_builder_uses_the_guard():
    vb = ViewBuilder(period_ms=100.0)
    assert vb.on_state(st(1), 0.0, NOW) is None
    assert vb.on_state(st(10 ** 9), 10.0, NOW) == "seq_jump"
    assert vb.on_state(st(2, sent=NOW + 3_600_000), 20.0, NOW) == "future"
    assert vb.on_state(st(2), 100.0, NOW) is None
    v = vb.build(150.0)
    assert [(n.node, n.batch_size, n.stale) for n in v.nodes] == [("decode-0", 2, False)]


def witness(lv: Liveness, now: float) -> Liveness:
    """``lv`` after hearing node ``w`` at ``now``: someone speaks, so the receiver is not deaf and a
    silent node can be judged (Liveness.deaf)."""
    lv.heard("w", now)
    return lv


def test_liveness_needs_silence_and_pauses_with_our_own_outage():
    lv = Liveness(timeout_ms=3000)
    lv.heard("a", 0)
    assert not witness(lv, 2900).dead("a", 2900) and witness(lv, 3100).dead("a", 3100)
    lv.heard("a", 3000)  # a token or heartbeat: alive again
    assert not witness(lv, 5000).dead("a", 5000)
    lv.pause()
    assert not witness(lv, 60_000).dead("a", 60_000)  # we were cut off: nobody is judged
    lv.resume(60_000)
    assert not witness(lv, 62_000).dead("a", 62_000) and witness(lv, 63_500).dead("a", 63_500)
    assert lv.dead_nodes(63_500) == {"a"}
    lv.watch("b", 63_000)  # never heard of: gets the full timeout from now
    assert not witness(lv, 65_000).dead("b", 65_000) and witness(lv, 66_500).dead("b", 66_500)
    assert not lv.dead("unknown", 10 ** 9)


def test_liveness_does_not_count_the_receivers_own_stall_as_silence():
    lv = Liveness(timeout_ms=1000)
    lv.heard("a", 0)
    lv.heard("b", 800)
    lv.stalled(2500)  # we did not run from ~200 to ~2700: what they sent then is still unread
    assert not lv.dead("a", 2700) and not lv.dead("b", 2700)
    assert lv.dead("a", 3600) and not lv.dead("b", 3600)  # silence after the stall still counts (b speaks)
    lv.stalled(0)
    lv.stalled(-5)  # no stall: nothing moves
    assert lv.silent_ms("b", 3600) == 300


def test_liveness_dead_only_after_more_than_the_timeout():
    lv = Liveness(timeout_ms=3000)
    lv.heard("a", 1000)
    assert not witness(lv, 4000).dead("a", 4000)  # silent exactly 3000 ms
    assert witness(lv, 4000.5).dead("a", 4000.5)


def test_liveness_keeps_the_epoch_of_the_last_heartbeat_not_of_tokens():
    lv = Liveness()
    assert lv.epoch("a") is None
    lv.heard("a", 0, E1)
    lv.heard("b", 0, E1 + 7)
    assert lv.epoch("a") == E1 and lv.epoch("b") == E1 + 7
    lv.heard("a", 10)  # a token: no epoch, the incarnation stays
    assert lv.epoch("a") == E1
    lv.heard("a", 20, E1 + 5)  # the agent restarted
    assert lv.epoch("a") == E1 + 5


def test_liveness_silent_ms_and_a_one_ms_stall():
    lv = Liveness()
    assert lv.silent_ms("never-heard", 12_345) == 0
    lv.heard("a", 100)
    assert lv.silent_ms("a", 350) == 250  # 350 − 100
    lv.stalled(1)  # a 1 ms stall still counts
    assert lv.silent_ms("a", 350) == 249  # 350 − (100 + 1)


def test_only_an_accepted_heartbeat_is_a_sign_of_life():
    g, lv = HeartbeatGuard(), Liveness(timeout_ms=1000)
    assert accept_heartbeat(g, lv, st(5), NOW, 250.0) is None
    assert lv.epoch("decode-0") == E1 and lv.silent_ms("decode-0", 1000) == 750  # heard at rx 250
    refused = [("replay", st(5)), ("replay", st(4)), ("future", st(6, sent=NOW + 3_600_000)),
               ("future", st(1, epoch=NOW + 3_600_000)), ("seq_jump", st(10 ** 9)), ("old_epoch", st(1, epoch=E1 - 5000))]
    for i, (why, hb) in enumerate(refused):
        assert accept_heartbeat(g, lv, hb, NOW, 300.0 + 100 * i) == why
    # none of them was heard: still last heard at 250, same incarnation, dead once 1000 ms have passed
    assert lv.silent_ms("decode-0", 1250) == 1000 and lv.epoch("decode-0") == E1
    assert witness(lv, 1251).dead("decode-0", 1251) and lv.dead_nodes(1251) == {"decode-0"}
    # the real next heartbeat (6 ≤ 5 + 5 + int(2 × 1000 / 100)) brings it back
    assert accept_heartbeat(g, lv, st(6), NOW, 1260.0) is None
    assert lv.silent_ms("decode-0", 1300) == 40 and not lv.dead("decode-0", 1300)
    assert accept_heartbeat(g, lv, st(1, epoch=E1 + 30_000), NOW, 1400.0) is None  # a restart: its new epoch
    assert lv.epoch("decode-0") == E1 + 30_000
    # another node's heartbeats are judged against its own history, not decode-0's (seq 1 < 6)
    other = msgspec.structs.replace(st(1), node="decode-1")
    assert accept_heartbeat(g, lv, other, NOW, 1500.0) is None
    assert lv.epoch("decode-1") == E1 and lv.silent_ms("decode-1", 1600) == 100


@pytest.mark.parametrize("keep", [0, -1])
def test_a_guard_that_would_remember_no_incarnation_is_refused(keep):
    with pytest.raises(ValueError) as e:
        HeartbeatGuard(keep_epochs=keep)
    assert str(e.value) == f"keep_epochs must be at least 1, got {keep}"
    assert HeartbeatGuard(keep_epochs=1).keep_epochs == 1  # one is enough (the current incarnation)


def test_a_node_with_a_long_heartbeat_period_is_dead_only_after_three_of_its_periods():
    # `kairos up --state-period-ms 5000`: 5 s of silence between two heartbeats is a live node (the
    # ingress used to drop such nodes after its 3 s timeout and fail their requests with node_lost)
    lv = Liveness(timeout_ms=3000)
    lv.heard("slow", 0, E1, 5000.0)
    lv.heard("fast", 0, E1, 100.0)
    lv.heard("one-s", 0, E1, 1000.0)  # 3 periods = the timeout: the timeout stands
    w = witness  # another node heard at the time of each check: the receiver is not deaf
    assert not w(lv, 14_999).dead("slow", 14_999) and w(lv, 15_001).dead("slow", 15_001)
    assert not lv.dead("fast", 2_999) and lv.dead("fast", 3_001)  # 3 × 100 ms < 3 s: the timeout governs
    assert not lv.dead("one-s", 2_999) and lv.dead("one-s", 3_001)  # ("slow" is within its 15 s meanwhile)
    assert lv.dead_nodes(4_000) == {"fast", "one-s"}
    lv.heard("slow", 15_000)  # a token (no period): the node keeps its period
    assert not w(lv, 29_999).dead("slow", 29_999) and w(lv, 30_001).dead("slow", 30_001)
    lv.heard("slow", 30_000, E1, 100.0)  # it restarted with a short period: the timeout governs again
    assert not w(lv, 32_999).dead("slow", 32_999) and w(lv, 33_001).dead("slow", 33_001)
    lv.heard("huge", 0, E1, 1e12)  # a period no agent can mean buys at most MAX_SILENCE_MS of silence
    assert not w(lv, 59_999).dead("huge", 59_999) and w(lv, 60_001).dead("huge", 60_001)
    lv.heard("odd", 0, E1, float("nan"))  # and an unreadable one changes nothing
    assert not w(lv, 2_999).dead("odd", 2_999) and w(lv, 3_001).dead("odd", 3_001)


def test_an_accepted_heartbeat_brings_its_period_into_liveness():
    g, lv = HeartbeatGuard(), Liveness(timeout_ms=1000)
    slow = msgspec.structs.replace(st(5), period_ms=2000.0)
    assert accept_heartbeat(g, lv, slow, NOW, 0.0) is None
    assert not witness(lv, 5_999).dead("decode-0", 5_999)  # 3 × 2000 ms, not 1000 ms
    assert witness(lv, 6_001).dead("decode-0", 6_001)


@pytest.mark.parametrize("field, value", [
    ("queue_prompt_tokens", [10 ** 200]), ("queue_prompt_tokens", [10 ** 9 + 1]), ("batch_size", 10 ** 7),
    ("kv_tokens", 10 ** 13), ("kv_backlog_ms", 1e300), ("kv_backlog_ms", -1.0),
    ("in_flight", [{"prompt_tokens": 10 ** 200, "output_tokens": 1}]),
])
def test_a_heartbeat_outside_the_policy_inputs_bounds_is_refused_when_decoded(field, value):
    """The heartbeat carries the policy input's bounds (kairos/core/cluster/snapshot.py): a prefill queue
    of 10^200 tokens, which ``msgspec`` decoded before, made every prefill node's TTFT infinite and
    ``pd`` keep the request on node ''. Refused at the decode, like any bad message."""
    from kairos.contracts.wire import WireError, decode

    good = {"node": "prefill-0", "role": "prefill", "seq": 1, "sent_unix_ms": NOW, "period_ms": 100.0}
    assert decode(msgspec.json.encode(good), NodeState).node == "prefill-0"
    with pytest.raises(WireError, match=field):
        decode(msgspec.json.encode({**good, field: value}), NodeState)



def test_when_every_node_is_silent_the_receiver_is_deaf_and_nobody_is_judged():
    """Positive evidence of death is a node's silence while others speak. An ingress whose NATS member
    was frozen for 3 s heard nobody (its connection looked fine) and declared all four nodes dead at
    once, cutting 21 streams (issue 32). Silence of everyone is the receiver's; a node that stays
    silent once the others are heard again is judged on its whole silence."""
    lv = Liveness(timeout_ms=1000)
    for n in ("p", "d0", "d1"):
        lv.heard(n, 0)
    assert not lv.deaf(900) and lv.deaf(1001)  # everyone silent beyond the limit: the receiver's fault
    assert lv.dead_nodes(3000) == set() and not lv.dead("d0", 3000)
    lv.heard("p", 3100)  # the receiver hears again: d1's heartbeats come too, d0's never
    lv.heard("d1", 3120)
    assert not lv.deaf(3200) and lv.dead("d0", 3200) and lv.dead_nodes(3200) == {"d0"}
    # a node that died before the receiver went deaf is judged once others speak again
    assert lv.dead_nodes(4150) == set()  # p (1050 ms) and d1 (1030 ms) silent too: deaf again
    lv.heard("p", 4200)
    assert lv.dead_nodes(4200) == {"d0", "d1"}
    # a node only watched (never heard) is no witness: it cannot make the receiver look hearing
    lone = Liveness(timeout_ms=1000)
    lone.heard("a", 0)
    lone.watch("b", 5000)
    assert lone.deaf(5000) and not lone.dead("a", 5000) and not Liveness().deaf(10 ** 9)
