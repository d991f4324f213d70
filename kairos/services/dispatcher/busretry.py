"""When a job that did not get through is the bus's fault, not the node's: send it again.

A dispatcher's job goes to the node through the request's ingress (issue 34). One answer says
nothing against the node itself:

* ``no_responders`` — the server the ingress is on knows no subscriber of the node's job subject:
  the node's agent is reconnecting (its server died; nats-py picks another member of the cluster and
  re-subscribes, and the route needs a moment to carry that interest), or the ingress itself just
  reconnected. The job never reached the node.

(A node that does not answer in time may run the job: the ingress moves the attempt under a new id
instead, kairos/services/ingress/jobrelay.py, and the routing ends.)

Excluding the node for them (what the dispatcher did for every failure) turned a one-second
failover into 503 ``no_available_node`` for every request in flight. :class:`BusRetry` instead
lets the routing loop try again — the policy decides afresh, the same node included — after a short
backoff, for at most ``budget_s`` per request, while the node is still live in the view (a node
that really died goes stale within 3 heartbeat periods and is left out by the snapshot, docs/bus.md).

Nothing runs twice: the ingress's arbiter sends no job of an attempt after a node accepted one.
"""

from __future__ import annotations

import time
from typing import Callable

#: job failures that are the bus's, not the node's (module docstring)
BUS_FAULTS = frozenset({"no_responders"})
#: first wait before a retry, s; doubled per retry up to BUS_RETRY_MAX_WAIT_S
BUS_RETRY_FIRST_WAIT_S = 0.05
BUS_RETRY_MAX_WAIT_S = 0.5


class BusRetry:
    """The bus-fault retries of one request's routing.

    Args:
        budget_s: retry for at most this long (s, from the first bus fault) before the node is
            excluded as before; 0: never retry.
        monotonic: the clock the budget is measured on (s; :meth:`kairos.runtime.clock.Clock.monotonic`).

    Raises:
        ValueError: ``budget_s`` < 0.
    """

    def __init__(self, budget_s: float, monotonic: Callable[[], float] = time.monotonic) -> None:
        if budget_s < 0:
            raise ValueError(f"budget_s must be >= 0, got {budget_s!r}")
        self.budget_s = budget_s
        self._monotonic = monotonic
        self.retries = 0  #: retries granted so far
        self._until: float | None = None

    def wait_s(self, why: str | None, node_live: bool) -> float | None:
        """The job failed with ``why``: seconds to wait before routing again (the node is not
        excluded), or None (not a bus fault, the node is no longer live, or the budget is spent:
        handle it as a refusal)."""
        if why not in BUS_FAULTS or not node_live:
            return None
        now = self._monotonic()
        if self._until is None:
            self._until = now + self.budget_s
        if now >= self._until:
            return None
        wait = min(BUS_RETRY_FIRST_WAIT_S * 2 ** self.retries, BUS_RETRY_MAX_WAIT_S, self._until - now)
        self.retries += 1
        return wait
