"""Tokens ahead of a gap wait for it (kairos/services/ingress/reorder.py), and the agent keeps what it
published lately for a resend after a reconnect (kairos/services/node_agent/outbox.py)."""

from __future__ import annotations

import pytest

from kairos.services.ingress.reorder import Reorder
from kairos.services.node_agent.outbox import Outbox
from kairos.contracts.events import DoneEvent, TokenEvent


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def tok(i: int, rid: str = "r") -> TokenEvent:
    return TokenEvent(request_id=rid, first_index=i, count=1, text=f"t{i}", node="decode-0", sent_unix_ms=0.0)


def done(n: int) -> DoneEvent:
    return DoneEvent(request_id="r", completion_tokens=n, node="decode-0", sent_unix_ms=0.0, finish_reason="length")


def test_events_ahead_of_a_gap_are_relayed_in_order_once_it_is_filled():
    clock = Clock()
    r = Reorder(1.0, clock)
    received = 2
    assert r.hold(tok(4), "r", received) and r.hold(done(5), "r", received) and r.hold(tok(3), "r", received)
    assert r.ready(received) is None  # 2 is missing
    assert not r.hold(tok(2), "r", received)  # the missing one: relayed at once
    out = []
    received = 3
    while (ev := r.ready(received)) is not None:
        out.append(ev)
        received += 1 if isinstance(ev, TokenEvent) else 0
    assert [e.first_index if isinstance(e, TokenEvent) else "done" for e in out] == [3, 4, "done"]
    assert len(r) == 0 and r.time_left() is None


def test_a_gap_never_filled_is_handed_on_after_the_wait():
    clock = Clock()
    r = Reorder(1.0, clock)
    assert r.hold(tok(5), "r", 2)
    clock.t += 0.5
    assert r.ready(2) is None and r.time_left() == pytest.approx(0.5)
    clock.t += 0.5
    assert r.ready(2).first_index == 5  # the lifecycle now sees the gap
    assert r.time_left() is None


def test_in_order_and_other_attempts_events_are_never_held():
    r = Reorder(1.0, Clock())
    assert not r.hold(tok(2), "r", 2)
    assert not r.hold(tok(7, rid="r-r1"), "r", 2)
    assert not r.hold(done(2), "r", 2)
    assert not Reorder(0.0, Clock()).hold(tok(5), "r", 2)
    with pytest.raises(ValueError):
        Reorder(-1.0)


def test_the_outbox_returns_what_was_sent_since_a_time_and_forgets_old_events():
    clock = Clock()
    box = Outbox(keep_s=10.0, clock=clock)
    box.sent("a", b"1")
    clock.t += 5
    box.sent("b", b"2")
    assert box.since(clock.t - 1) == [("b", b"2")]
    assert box.since(0) == [("a", b"1"), ("b", b"2")]
    clock.t += 6
    box.sent("c", b"3")
    assert box.since(0) == [("b", b"2"), ("c", b"3")]
    with pytest.raises(ValueError):
        Outbox(keep_s=0)
