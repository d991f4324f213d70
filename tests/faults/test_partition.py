"""A decode node cut off from the bus for 10 s, then back (issue 33), with real processes: its agent
runs in a network namespace of its own (``ip netns``, a veth pair to the host, where nats-server
listens), and the host's end of the link is set down, then up. Where no namespace can be made (no
root), the agent is paused instead (SIGSTOP / SIGCONT), as the issue allows.

While it is cut off, the ingress hears neither its heartbeats nor its tokens: it declares it dead and
its streams migrate to decode-0. It goes on decoding for nobody; back on the bus, what it sends of
those attempts is dropped (never relayed) and it is told to stop. Checked against the emulated
engine's own output of each prompt: 0 failed, 0 wrong text (a duplicated or foreign token would be
one), 0 forged; some streams migrated.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
import uuid

import aiohttp
import pytest

from tests.faults.conftest import expected_text, request

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

CUT_S = 10.0  #: how long the node is cut off
RATE, LOAD_S, CUT_AT_S, MAX_TOKENS = 6.0, 26.0, 6.0, 150


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


class Netns:
    """A network namespace joined to the host by a veth pair (host 10.213.<k>.1, namespace .2)."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:6]
        k = int(tag[:2], 16)
        self.ns, self.host_if, self.ns_if = f"kairos-{tag}", f"vkh{tag}", f"vkn{tag}"
        self.host_ip, self.ns_ip = f"10.213.{k}.1", f"10.213.{k}.2"
        self.made = False

    def make(self) -> bool:
        """Create it; False (nothing left behind) where this machine does not allow it."""
        if os.geteuid() != 0 or shutil.which("ip") is None:
            return False
        steps = [("netns", "add", self.ns), ("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if),
                 ("link", "set", self.ns_if, "netns", self.ns), ("addr", "add", f"{self.host_ip}/30", "dev", self.host_if),
                 ("link", "set", self.host_if, "up"),
                 ("netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if),
                 ("netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up"),
                 ("netns", "exec", self.ns, "ip", "link", "set", "lo", "up")]
        self.made = True
        for s in steps:
            if ip(*s).returncode != 0:
                self.remove()
                return False
        return True

    def link(self, up: bool) -> None:
        r = ip("link", "set", self.host_if, "up" if up else "down")
        assert r.returncode == 0, r.stderr

    def remove(self) -> None:
        if self.made:
            ip("link", "del", self.host_if)
            ip("netns", "del", self.ns)
            self.made = False


async def test_a_decode_node_cut_off_for_10_s_loses_and_garbles_nothing(cluster):
    net = Netns()
    isolated = net.make()
    try:
        cluster.nats_host = "0.0.0.0" if isolated else "127.0.0.1"
        cluster.start_nats()
        cluster.start("state_aggregator")
        for a in cluster.agents:
            if a == "decode-1" and isolated:  # its own host: NATS over the veth link
                cluster.start(a, prefix=("ip", "netns", "exec", net.ns),
                              KAIROS_NATS_URL=f"nats://{net.host_ip}:{cluster.nats_port}")
            else:
                cluster.start(a)
        for i in range(2):
            cluster.start(f"dispatcher-{i}")
        cluster.start("ingress")
        cluster.wait_routable()
        forged0 = cluster.metric("kairos_ingress_forged_messages_total", '{kind="out_event"}')
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            tasks: list[asyncio.Task] = []
            t0 = time.monotonic()
            cut = healed = None
            while time.monotonic() - t0 < LOAD_S:
                now = time.monotonic() - t0
                if cut is None and now >= CUT_AT_S:
                    cut = time.monotonic()
                    if isolated:
                        net.link(False)
                    else:
                        cluster.pause("decode-1")
                if cut is not None and healed is None and time.monotonic() - cut >= CUT_S:
                    healed = time.monotonic()
                    if isolated:
                        net.link(True)
                    else:
                        cluster.resume("decode-1")
                tasks.append(asyncio.create_task(request(http, cluster.base, MAX_TOKENS, stream=True, prompt_len=100,
                                                         deadline_s=90)))
                await asyncio.sleep(1.0 / RATE)  # the load's pace (open loop), not a synchronisation
            outcomes = await asyncio.gather(*tasks)
        migrated = cluster.metric("kairos:request_migrations_total")
        late = cluster.metric("kairos_ingress_dropped_events_total", '{reason="old_attempt"}')
        forged = cluster.metric("kairos_ingress_forged_messages_total", '{kind="out_event"}') - forged0
    finally:
        if isolated:
            with_link = net.made
            if with_link:
                ip("link", "set", net.host_if, "up")
        else:
            try:
                cluster.resume("decode-1")
            except (KeyError, ProcessLookupError):
                pass
        cluster.stop_all()
        net.remove()
    failed = [o for o in outcomes if not o.ok]
    wrong = [o for o in outcomes if o.ok and o.text != expected_text(o.prompt, MAX_TOKENS)]
    summary = {"isolated_by": "netns" if isolated else "SIGSTOP", "sent": len(outcomes), "failed": len(failed),
               "wrong_text": len(wrong), "migrated": migrated, "late_events_dropped": late, "forged": forged,
               "errors": sorted({str((o.error or {}).get("code")) for o in failed})}
    print("partition:", summary)
    assert healed is not None and len(outcomes) >= RATE * LOAD_S * 0.8, summary
    assert not failed and not wrong and forged == 0, summary
    assert migrated >= 1, summary  # streams were on the node cut off: they moved
