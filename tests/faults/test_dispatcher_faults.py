"""A dispatcher killed at every step of the routing protocol, and one stalled past the ingress's
route stall: the ingress sends the request again, to another replica, and the attempt's arbiter (the
ingress sends every job itself, issue 34) makes sure it runs at most once — with exactly one stream
in the response (issue 10, required behaviour 2)."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import pytest

from kairos.services.dispatcher.faults import FAULT_EXIT_CODE, STEPS
from tests.faults.conftest import Cluster, apoll, check, request

pytestmark = pytest.mark.faults

N = 4  #: requests per step (the first one to reach the step kills the replica; the others die with it)


@pytest.fixture
def no_dispatcher_cluster(cluster: Cluster) -> Cluster:
    # enough deflection slots that a deflecting replica never falls back to the prefill node
    cluster.env.update(KAIROS_MAX_DEFLECTIONS="8", KAIROS_MAX_DEFLECTIONS_PER_NODE="8")
    cluster.up(dispatchers=0)
    return cluster


async def test_dispatcher_killed_at_every_protocol_step(no_dispatcher_cluster: Cluster):
    c = no_dispatcher_cluster
    report = {}
    async with aiohttp.ClientSession() as http:
        def kept() -> int:  # jobs accepted by the prefill node: the dying replica's (pd) choice
            return sum(1 for e in c.log_events("job_accepted") if e["_log"].startswith("prefill"))
        for step in STEPS:
            kept_before = kept()
            # the dying replica keeps every request (prefill node), its successor deflects every one
            # (decode nodes): a redelivered request always lands on a node other than its first one
            faulty = c.start("dispatcher-0", as_name=f"dispatcher-0-{step}", KAIROS_FAULT_AT=step,
                             KAIROS_REPLICA_ID=f"faulty-{step}", KAIROS_POLICY="pd")
            sends = [asyncio.create_task(request(http, c.base, max_tokens=12, stream=i % 2 == 0)) for i in range(N)]
            await apoll(lambda: faulty.poll() is not None, 30, f"the dispatcher to die at {step}")
            assert faulty.returncode == FAULT_EXIT_CODE, (step, faulty.returncode, c.tail(f"dispatcher-0-{step}"))
            healthy = c.start("dispatcher-1", as_name=f"dispatcher-1-{step}", KAIROS_REPLICA_ID=f"healthy-{step}",
                              KAIROS_POLICY="sl:100000")
            outcomes = await asyncio.gather(*sends)
            report[step] = check(outcomes, c, allow_errors=False)
            os_kill_and_wait(healthy)
            report[step]["kept"] = kept() - kept_before
            report[step]["slowest_s"] = round(max(o.elapsed_s for o in outcomes), 2)
            if step in ("after_publish", "after_accept"):
                # the dying replica had handed its job to the ingress, which sent it: the prefill node
                # ran it, nobody routed it again (and check() found no request run twice)
                assert report[step]["kept"] >= 1, (step, report[step])
    assert c.executions(), "no job was ever accepted"
    print("dispatcher kills:", report)


def os_kill_and_wait(p) -> None:
    p.send_signal(signal.SIGTERM)
    p.wait(15)


async def test_dispatcher_stalled_past_the_route_stall_does_not_run_requests_twice(no_dispatcher_cluster: Cluster):
    """SIGSTOP (self-inflicted at ``after_accept``, i.e. the node accepted, no routing event) for
    longer than the ingress's route stall. The ingress sent the job and saw the node accept it, so
    that request streams on while its dispatcher is stopped; a request the stalled replica held
    before a node accepted it is sent again after the route stall and routed by another replica.
    Every request completes — while the replica is still stopped — once, with one stream; then
    SIGCONT: the stalled replica carries on, and its stale jobs meet the arbiter."""
    c = no_dispatcher_cluster
    stalled = c.start("dispatcher-0", as_name="dispatcher-stalled", KAIROS_FAULT_AT="after_accept",
                      KAIROS_FAULT_MODE="stop", KAIROS_REPLICA_ID="stalled", KAIROS_POLICY="pd")
    async with aiohttp.ClientSession() as http:
        sends = [asyncio.create_task(request(http, c.base, max_tokens=20, stream=i % 2 == 0)) for i in range(N)]

        def stopped() -> bool:
            with open(f"/proc/{stalled.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        await apoll(stopped, 30, "the dispatcher to stop itself after a node accepted")
        c.start("dispatcher-1", KAIROS_REPLICA_ID="healthy", KAIROS_POLICY="sl:100000")
        outcomes = await asyncio.gather(*sends)  # all of them, the stalled replica still stopped
        c.resume("dispatcher-stalled")
    counts = check(outcomes, c, allow_errors=False)
    assert stalled.poll() is None, "the stalled replica must carry on after SIGCONT"
    print("stalled dispatcher:", counts)
