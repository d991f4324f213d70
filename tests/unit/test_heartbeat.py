"""Heartbeat validation (epoch + seq, future timestamps) and liveness (shared/heartbeat.py, shared/view.py)."""

from __future__ import annotations

from shared.heartbeat import HeartbeatGuard, Liveness
from shared.view import ViewBuilder
from shared.wire import NodeState

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
    assert check(g, 12, rx=400) is None  # ...until the forged epoch has been silent for stale_after_ms


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


def test_liveness_needs_silence_and_pauses_with_our_own_outage():
    lv = Liveness(timeout_ms=3000)
    lv.heard("a", 0)
    assert not lv.dead("a", 2900) and lv.dead("a", 3100)
    lv.heard("a", 3000)  # a token or heartbeat: alive again
    assert not lv.dead("a", 5000)
    lv.pause()
    assert not lv.dead("a", 60_000)  # we were cut off: nobody is judged
    lv.resume(60_000)
    assert not lv.dead("a", 62_000) and lv.dead("a", 63_500)
    assert lv.dead_nodes(63_500) == {"a"}
    lv.watch("b", 63_000)  # never heard of: gets the full timeout from now
    assert not lv.dead("b", 65_000) and lv.dead("b", 66_500)
    assert not lv.dead("unknown", 10 ** 9)


def test_liveness_does_not_count_the_receivers_own_stall_as_silence():
    lv = Liveness(timeout_ms=1000)
    lv.heard("a", 0)
    lv.heard("b", 800)
    lv.stalled(2500)  # we did not run from ~200 to ~2700: what they sent then is still unread
    assert not lv.dead("a", 2700) and not lv.dead("b", 2700)
    assert lv.dead("a", 3600) and not lv.dead("b", 3600)  # silence after the stall still counts
    lv.stalled(0)
    lv.stalled(-5)  # no stall: nothing moves
    assert lv.silent_ms("b", 3600) == 300
