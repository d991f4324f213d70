"""kairos.runtime.buswatch.BusWatch's state machine on a stand-in connection (it reads only
``is_connected``, ``is_closed`` and ``stats["reconnects"]``; tests/integration/test_nats_cluster.py
runs it on a real cluster): a reconnect that comes while the re-declare of the previous one is still
waiting on JetStream gets its ``on_connected`` at once — the ingress's resend request, without which
the token events lost in that outage are never sent again — and the re-declare runs once more."""

import asyncio

from tests.integration.conftest import wait_until

from kairos.runtime.buswatch import BusWatch


class Connection:
    def __init__(self) -> None:
        self.is_connected, self.is_closed = True, False
        self.stats = {"reconnects": 0}

    def reconnect(self) -> None:  # dropped and back within one poll: only the counter tells
        self.stats["reconnects"] += 1


async def test_a_reconnect_during_a_slow_redeclare_is_announced_at_once_and_redeclared():
    nc, connected, declares = Connection(), [], []
    jetstream = asyncio.Event()  # the re-declare waits on JetStream until this is set

    async def on_connected() -> None:
        connected.append(nc.stats["reconnects"])

    async def redeclare() -> None:
        declares.append(nc.stats["reconnects"])
        await jetstream.wait()

    watch = BusWatch(nc, redeclare, on_connected=on_connected, poll_s=0.005, retry_s=0.005).start()
    try:
        nc.reconnect()
        await wait_until(lambda: declares == [1], 5, "the first reconnect's re-declare started")
        assert connected == [1] and watch.resuming
        nc.reconnect()  # the first re-declare is still waiting
        await wait_until(lambda: connected == [1, 2], 5, "the second reconnect announced")
        assert declares == [1], "announced without waiting for the re-declare under way"
        jetstream.set()
        await wait_until(lambda: not watch.resuming, 5, "resumed")
        assert declares == [1, 2], "declared again for the server reached by the second reconnect"
        assert watch.reconnects == 2
    finally:
        await watch.stop()


async def test_one_reconnect_is_announced_and_redeclared_once():
    nc, connected, declares = Connection(), [], []

    async def on_connected() -> None:
        connected.append(nc.stats["reconnects"])

    async def redeclare() -> None:
        declares.append(nc.stats["reconnects"])

    watch = BusWatch(nc, redeclare, on_connected=on_connected, poll_s=0.005, retry_s=0.005).start()
    try:
        nc.reconnect()
        await wait_until(lambda: watch.reconnects == 1, 5, "resumed")
        assert connected == [1] and declares == [1] and not watch.resuming
    finally:
        await watch.stop()
