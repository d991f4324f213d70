"""Jobs to node agents, through the request's ingress (the router's bus, a fake in unit tests).

Issue 34's request path (docs/bus.md, "The request path"): a dispatcher does not send a job to the
node itself. It sends it to the attempt's conversation subject in the ingress's inbox (the request's
``Kairos-Notices`` header) as a request-reply; the ingress — the one sender of the attempt's jobs —
lets it go to ``kairos.jobs.<node>`` when its arbiter allows (:mod:`kairos.core.cluster.arbiter`),
and answers with the node's :class:`~kairos.contracts.wire.JobAck`, or one of its own. The job goes
without its request (:func:`~kairos.contracts.wire.job_plan`: the ingress holds it and splices it
back in), so the dispatcher never encodes the prompt: no agent
subscribed (``no_responders``), the node did not answer in time (``timeout``: the ingress moves the
attempt), or the job was not sent (``cancelled``). The trace context travels in the headers. The link
also tells the router whether this replica is connected, and whether NATS just came back here
(:meth:`kairos.runtime.buswatch.BusWatch.settling`: the agents may not have re-subscribed yet).
"""

from __future__ import annotations

from typing import Callable

import nats.errors
from nats.aio.client import Client

from kairos.contracts.wire import Job, JobAck, decode, job_plan
from kairos.runtime import telemetry
from kairos.runtime.bus import flush_barrier
from kairos.runtime.buswatch import BusWatch

#: how much longer than a node has (``job_ack_timeout_s``) the dispatcher waits for the ingress's
#: answer (s): the ingress waits for the node first, then relays
RELAY_SLACK_S = 1.0


class IngressGone(RuntimeError):
    """The request's ingress did not take or answer the job (it died, or its NATS member did): the
    request is worth nothing now (its client's connection was there), or the ingress sends it again."""


class JobLink:
    """The dispatcher's side of the job protocol on ``nc``.

    Args:
        nc: the replica's connection (a callable returning it: it is opened after the link is built).
        timeout_s: how long a node has to answer a job (``job_ack_timeout_s``).
        watch: the replica's :class:`BusWatch` (a callable: None before it starts).
    """

    def __init__(self, nc: Callable[[], Client], timeout_s: float, watch: Callable[[], BusWatch | None]) -> None:
        self._nc, self.timeout_s, self._watch = nc, timeout_s, watch

    async def request(self, node: str, job: Job, via: str) -> JobAck:
        """Hand ``job`` for ``node`` (``job.node``) to the request's ingress at ``via`` (its
        conversation subject) and wait for the node's answer as the ingress relays it.

        Raises:
            IngressGone: nobody subscribes to ``via``, or no answer within ``timeout_s`` + :data:`RELAY_SLACK_S`.
            kairos.contracts.wire.WireError: the answer does not decode.
        """
        try:
            reply = await self._nc().request(via, job_plan(job), timeout=self.timeout_s + RELAY_SLACK_S,
                                             headers=telemetry.inject_headers())
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise IngressGone(f"the ingress did not relay the job for {node}: {exc!r}") from exc
        return decode(reply.data, JobAck)

    async def send_unanswered(self, node: str, job: Job, via: str) -> None:
        """Hand ``job`` to the ingress and make sure the server has it, not waiting for the answer
        (the fault tier's ``after_publish`` step: the replica dies right after)."""
        nc = self._nc()
        await nc.publish(via, job_plan(job), reply=nc.new_inbox(), headers=telemetry.inject_headers())
        await flush_barrier(nc)

    def connected(self) -> bool:
        """This replica's NATS connection is up."""
        nc = self._nc()
        return nc is not None and nc.is_connected

    def settling(self, window_s: float) -> bool:
        """Within ``window_s`` of this replica's (re)connect, or disconnected (BusWatch.settling)."""
        watch = self._watch()
        return watch is not None and watch.settling(window_s)
