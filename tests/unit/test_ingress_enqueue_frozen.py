"""NatsIngressBus.enqueue on a server that stops answering (kairos/services/ingress/nats_bus.py):
after a request to the dispatchers times out, a server that answers no PING within
UNRESPONSIVE_PONG_S is frozen or cut off, and the enqueue gives up at once — on the still-open
connection, so the attempt's cancel and tombstone follow its request there (docs/bus.md, at most
once). A server that answers pings (no dispatcher answered in time) is tried again until
KAIROS_ENQUEUE_TIMEOUT_S. The PING's waiter is never cancelled (nats-py's read loop would break on
its late PONG)."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from kairos.runtime.clock import ManualClock
from kairos.contracts import subjects as S
from kairos.services.ingress.nats_bus import TAKEN_TIMEOUT_S, UNRESPONSIVE_PONG_S, NatsIngressBus
from kairos.services.ingress.ports import NoDispatcher


class FakeNc:
    """A connected client whose PINGs are answered (``pong``) or never."""

    is_connected, is_closed = True, False

    def __init__(self, pong: bool, clock: ManualClock) -> None:
        self.pong, self.clock = pong, clock
        self.pings: list[asyncio.Future] = []
        self.publishes = 0
        self.deliveries: list[str] = []  #: each copy's Kairos-Delivery

    async def request(self, subject, body, headers=None, timeout=None):
        self.publishes += 1
        self.deliveries.append(headers[S.DELIVERY_HEADER])
        await self.clock.sleep(timeout)  # no dispatcher answers within the try's timeout
        raise nats.errors.TimeoutError

    async def flush(self, timeout: float) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.pings.append(fut)
        if self.pong:
            fut.set_result(True)
        await fut  # a frozen server: never answered (the test ends it)


class Retries:
    def __init__(self) -> None:
        self.n = 0

    def inc(self) -> None:
        self.n += 1


class Metrics:
    def __init__(self) -> None:
        self.enqueue_retries = Retries()


def bus(pong: bool, clock: ManualClock) -> tuple[NatsIngressBus, FakeNc]:
    nc = FakeNc(pong, clock)
    b = NatsIngressBus(nc, 1, None, enqueue_timeout_s=15.0, metrics=Metrics(), clock=clock, log=None)
    b.disconnected_since = lambda: None
    return b, nc


async def failed_enqueue(pong: bool) -> tuple[NatsIngressBus, FakeNc, float]:
    """An enqueue that no dispatcher takes, on a server answering PINGs or not: the bus, its fake
    and how long (s, manual clock) the enqueue took to give up (a frozen server: nats-py's
    TimeoutError; one that answers: NoDispatcher, naming how long it tried)."""
    clock = ManualClock()
    b, nc = bus(pong=pong, clock=clock)
    start = clock.monotonic()
    with pytest.raises(NoDispatcher if pong else nats.errors.TimeoutError) as e:
        await b.enqueue(b"{}", {})
    assert not pong or str(e.value) == "no dispatcher took it within 15 s"
    return b, nc, clock.monotonic() - start


async def test_a_frozen_server_is_given_up_after_one_try_and_a_ping():
    _, nc, took_s = await failed_enqueue(pong=False)
    assert nc.publishes == 1 and len(nc.pings) == 1
    assert took_s == pytest.approx(TAKEN_TIMEOUT_S + UNRESPONSIVE_PONG_S)  # not the 15 s enqueue timeout
    assert not nc.pings[0].cancelled()  # the waiter stays for its late PONG
    nc.pings[0].set_result(True)  # the PONG after all: nothing breaks
    await asyncio.sleep(0)


async def test_a_server_that_answers_pings_is_tried_until_the_enqueue_timeout():
    b, nc, took_s = await failed_enqueue(pong=True)
    assert took_s >= 15.0 - 0.2  # sent again at once after each unanswered try, until the deadline
    # a ping after each timed-out try but the last
    assert nc.publishes >= 15.0 / (TAKEN_TIMEOUT_S + UNRESPONSIVE_PONG_S) and len(nc.pings) == nc.publishes - 1
    assert b.m.enqueue_retries.n == nc.publishes - 1
    assert nc.deliveries == [str(i) for i in range(1, nc.publishes + 1)]  # each copy numbered
