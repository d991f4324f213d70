"""The faults tier's "no permission violation" check (:func:`tests.faults.conftest.check`) fails
when a real nats-server logged a real violation — it could never fail while it searched for a text
nats-server 2.15 does not log."""

from __future__ import annotations

import pytest

from kairos.contracts import subjects as S
from kairos.runtime.bus import flush_barrier
from kairos.contracts.permissions import agent_user
from tests.faults.conftest import Cluster, apoll, check

pytestmark = pytest.mark.faults


async def test_a_real_permission_violation_fails_the_check(cluster: Cluster):
    cluster.start_nats()
    nc = await cluster.connect(agent_user("decode-0"))
    try:
        await nc.publish(S.state_subject("decode-0"), b"own subject: allowed")
        await flush_barrier(nc)
        assert cluster.permission_violations() == []
        assert check([], cluster)["sent"] == 0  # nothing wrong yet: the check passes
        await nc.publish(S.state_subject("decode-1"), b"another node's heartbeat")
        await nc.subscribe(S.jobs_subject("decode-1"))
        await flush_barrier(nc)
        lines = await apoll(lambda: len(cluster.permission_violations()) == 2 and cluster.permission_violations(),
                            5, "both violations in the nats-server log")
    finally:
        await nc.close()
    assert "Publish Violation" in lines[0] and S.state_subject("decode-1") in lines[0]
    assert "Subscription Violation" in lines[1] and S.jobs_subject("decode-1") in lines[1]
    with pytest.raises(AssertionError, match="Violation"):
        check([], cluster)
