"""``kairos.runtime.bus.flush_barrier`` against a real nats-server: its protocol trace (``-DV``) shows the
order in which the server processed one connection's commands, an independent truth for "the
server has seen everything sent before the barrier returned"."""

from __future__ import annotations

import re

import nats
import pytest

from kairos.runtime.bus import flush_barrier
from tests.integration.conftest import running_nats

pytestmark = pytest.mark.integration


def _commands(log: str, client_id: str) -> list[str]:
    """The protocol commands the server read from connection ``cid:<client_id>``, in order."""
    return re.findall(rf"cid:{client_id} - .*? <<- \[(\w+)", log)


async def test_the_barrier_returns_only_after_the_server_processed_earlier_subscriptions(tmp_path):
    log = tmp_path / "nats.log"
    with running_nats(tmp_path / "js", "-DV", "-l", str(log)) as port:
        nc = await nats.connect(f"nats://127.0.0.1:{port}")
        cid = str(nc._client_id)
        for k in range(20):
            await nc.subscribe(f"barrier.test.{k}")
            await flush_barrier(nc)
            # after the barrier: the server has read this SUB, and a PING after it (whose PONG we got)
            seen = _commands(log.read_text(), cid)
            assert seen.count("SUB") == k + 1, seen
            assert "PING" in seen[len(seen) - 1 - seen[::-1].index("SUB"):], seen
        await nc.close()
