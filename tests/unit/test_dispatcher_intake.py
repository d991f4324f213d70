"""The dispatcher's intake (kairos/services/dispatcher/intake.py) with fake messages: every request is
answered ``taken`` before it is routed, a ping is answered and never routed, a waiting routing sends
``alive`` to the attempt's notice subject, and the delivery count comes from the ingress's header."""

from __future__ import annotations

import asyncio

from kairos.contracts import subjects as S
from kairos.runtime.clock import ManualClock
from kairos.services.dispatcher.intake import STALE_COPY_MS, RequestIntake, RouteMessage


class Nc:
    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes) -> None:
        self.published.append((subject, data))


class Msg:
    def __init__(self, headers: dict | None, data: bytes = b"{}") -> None:
        self.headers, self.data, self.subject = headers, data, S.ROUTE_SUBJECT
        self.answers: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(data)


class Log:
    def debug(self, *a, **k) -> None:
        pass

    error = info = warning = debug


def intake() -> tuple[RequestIntake, list]:
    routed: list = []
    it = RequestIntake(lambda: Nc(), None, None, None, None, max_concurrency=1, log=Log())

    async def handle(msg) -> None:
        routed.append(msg)
    it.handle = handle  # what is routed, not how
    return it, routed


async def test_a_request_is_answered_taken_and_routed_and_a_ping_only_answered():
    it, routed = intake()
    req, ping = Msg({S.NOTICES_HEADER: "_INBOX.ingress.x.cmpl-1", S.DELIVERY_HEADER: "2"}), Msg({S.PING_HEADER: "1"})
    await it.on_request(req)
    await it.on_request(ping)
    await it.in_flight.wait_all()
    assert req.answers == [S.TAKEN] and ping.answers == [S.TAKEN]
    assert len(routed) == 1 and routed[0].delivery == 2 and routed[0].notices == "_INBOX.ingress.x.cmpl-1"


async def test_a_stopped_intake_answers_nothing_so_the_ingress_sends_it_elsewhere():
    it, routed = intake()
    it.stopped = True
    req = Msg({})
    await it.on_request(req)
    assert req.answers == [] and routed == []


async def test_alive_goes_to_the_notice_subject_and_a_bad_delivery_header_counts_as_the_first():
    nc = Nc()
    m = RouteMessage(Msg({S.NOTICES_HEADER: "_INBOX.ingress.x.cmpl-1", S.DELIVERY_HEADER: "many"}), lambda: nc, Log())
    await m.in_progress()
    assert nc.published == [("_INBOX.ingress.x.cmpl-1", S.ALIVE)] and m.delivery == 1
    quiet = RouteMessage(Msg(None), lambda: nc, Log())  # no notice subject: nothing to tell
    await quiet.in_progress()
    assert len(nc.published) == 1


async def test_a_routing_waiting_for_room_sends_alive(monkeypatch):
    from kairos.services.dispatcher import intake as I

    monkeypatch.setattr(I, "ALIVE_EVERY_S", 0.01)
    nc = Nc()
    it = RequestIntake(lambda: nc, None, None, None, None, max_concurrency=1, log=Log())
    await it._sem.acquire()  # every slot taken
    m = RouteMessage(Msg({S.NOTICES_HEADER: "n.cmpl-2"}), lambda: nc, Log())
    waiting = asyncio.ensure_future(it._room(m))
    while len(nc.published) < 2:
        await asyncio.sleep(0.01)
    it._sem.release()
    await asyncio.wait_for(waiting, 1)
    assert set(nc.published) == {("n.cmpl-2", S.ALIVE)}


class Count:
    def __init__(self) -> None:
        self.n = 0

    def inc(self) -> None:
        self.n += 1


async def test_a_copy_that_arrives_long_after_it_was_sent_is_dropped_unanswered():
    """A replica frozen for seconds gets every copy the ingress sent meanwhile: the old ones are
    dropped (another copy is out), the recent one is taken."""
    clock = ManualClock()
    routed: list = []
    m = type("M", (), {"stale_copies": Count()})()
    it = RequestIntake(lambda: Nc(), None, None, m, None, max_concurrency=1, log=Log(), clock=clock)

    async def handle(msg) -> None:
        routed.append(msg)
    it.handle = handle
    old = Msg({S.SENT_HEADER: f"{clock.now_ms() - STALE_COPY_MS - 1:.0f}"})
    recent = Msg({S.SENT_HEADER: f"{clock.now_ms() - 400:.0f}"})
    await it.on_request(old)
    await it.on_request(recent)
    await it.in_flight.wait_all()
    assert old.answers == [] and recent.answers == [S.TAKEN] and len(routed) == 1 and m.stale_copies.n == 1
