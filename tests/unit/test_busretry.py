"""The dispatcher's bus-fault retries (kairos/services/dispatcher/busretry.py): which failures are the
bus's, the backoff, the per-request budget."""

from __future__ import annotations

import pytest

from kairos.services.dispatcher.busretry import BUS_RETRY_FIRST_WAIT_S, BUS_RETRY_MAX_WAIT_S, BusRetry


@pytest.mark.parametrize("why", ["no_responders"])
def test_bus_faults_of_a_live_node_are_retried_with_backoff(why):
    r = BusRetry(60.0)
    waits = [r.wait_s(why, node_live=True) for _ in range(6)]
    assert waits[0] == BUS_RETRY_FIRST_WAIT_S
    assert all(b >= a for a, b in zip(waits, waits[1:])), waits  # growing
    assert max(waits) == BUS_RETRY_MAX_WAIT_S  # capped
    assert r.retries == 6


@pytest.mark.parametrize("why", [None, "draining", "wrong_role", "deflection_in_flight", "engine_refused: x",
                                 "timeout", "cancelled"])  # timeout: the ingress moved the attempt
def test_a_refusal_by_the_node_is_not_retried(why):
    assert BusRetry(60.0).wait_s(why, node_live=True) is None


def test_a_node_no_longer_live_is_not_retried():
    assert BusRetry(60.0).wait_s("no_responders", node_live=False) is None


def test_the_budget_bounds_the_retries():
    r = BusRetry(0.0)
    assert r.wait_s("timeout", node_live=True) is None  # 0: never retry
    with pytest.raises(ValueError, match="budget_s"):
        BusRetry(-1.0)
