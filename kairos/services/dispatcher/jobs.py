"""Jobs to node agents over the replica's NATS connection (the router's bus, a fake in unit tests).

A job is a request-reply on ``kairos.jobs.<node>`` (:func:`kairos.contracts.subjects.jobs_subject`):
the node answers a :class:`~kairos.contracts.wire.JobAck` — accepted, or refused with a reason
(docs/bus.md) — within ``job_ack_timeout_s``. The trace context travels in the headers. The link
also tells the router whether this replica is connected, and whether NATS just came back here
(:meth:`kairos.runtime.buswatch.BusWatch.settling`: the agents may not have re-subscribed yet).
"""

from __future__ import annotations

from typing import Callable

from nats.aio.client import Client

from kairos.contracts import subjects as S
from kairos.contracts.wire import Job, JobAck, encode
from kairos.runtime import telemetry
from kairos.runtime.bus import flush_barrier
from kairos.runtime.buswatch import BusWatch
from kairos.runtime.messaging import request_typed


class JobLink:
    """The dispatcher's side of the job protocol on ``nc``.

    Args:
        nc: the replica's connection (a callable returning it: it is opened after the link is built).
        timeout_s: how long a node has to answer a job (``job_ack_timeout_s``).
        watch: the replica's :class:`BusWatch` (a callable: None before it starts).
    """

    def __init__(self, nc: Callable[[], Client], timeout_s: float, watch: Callable[[], BusWatch | None]) -> None:
        self._nc, self.timeout_s, self._watch = nc, timeout_s, watch

    async def request(self, node: str, job: Job) -> JobAck:
        """Send ``job`` to ``node`` and wait for its answer.

        Raises:
            nats.errors.NoRespondersError: no agent subscribes to the node's job subject here.
            nats.errors.TimeoutError: no answer within ``timeout_s``.
            kairos.contracts.wire.WireError: the answer does not decode.
        """
        return await request_typed(self._nc(), S.jobs_subject(node), job, JobAck, self.timeout_s,
                                   telemetry.inject_headers())

    async def send_unanswered(self, node: str, job: Job) -> None:
        """Send ``job`` and make sure the server has it, not waiting for the answer (the fault tier's
        ``after_publish`` step: the replica dies right after)."""
        nc = self._nc()
        await nc.publish(S.jobs_subject(node), encode(job), reply=nc.new_inbox(), headers=telemetry.inject_headers())
        await flush_barrier(nc)

    def connected(self) -> bool:
        """This replica's NATS connection is up."""
        nc = self._nc()
        return nc is not None and nc.is_connected

    def settling(self, window_s: float) -> bool:
        """Within ``window_s`` of this replica's (re)connect, or disconnected (BusWatch.settling)."""
        watch = self._watch()
        return watch is not None and watch.settling(window_s)
