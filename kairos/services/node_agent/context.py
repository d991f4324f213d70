"""What the node agent's parts share: the node's settings, its engine, its connection and clock, its requests.

:class:`~.agent.NodeAgent` builds one :class:`NodeContext` and hands it to each part (:mod:`.jobs`,
:mod:`.kv`, :mod:`.effects`, :mod:`.steps`, :mod:`.heartbeat`); a unit test builds one around fakes
(a bus that records what it publishes, a manual clock) and drives a part's
protocol logic without a nats-server. The connection ``nc`` is any object with nats-py's
``publish``/``request``/``jetstream`` as far as the part uses them; it is None until the agent
connects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kairos.contracts import subjects as S
from kairos.contracts.origin import OriginGuard
from kairos.contracts.permissions import agent_user
from kairos.core.cluster.recent import RecentIds
from kairos.core.model.latency import LatencyModel
from kairos.engines.base import EngineBackend
from kairos.runtime import telemetry
from kairos.runtime.clock import SYSTEM_CLOCK, Clock
from kairos.runtime.resources import BackgroundTasks
from kairos.services.node_agent.config import AgentConfig
from kairos.services.node_agent.metrics import AgentMetrics
from kairos.services.node_agent.request import NodeRequest
from kairos.services.node_agent.tracing import spans_of

#: how many cancelled request ids a node agent remembers (a job delayed past its request's end)
CANCELLED_REMEMBERED = 10_000


@dataclass
class NodeContext:
    """The node's shared state (one per agent).

    Attributes:
        reqs: the requests this node holds, by bus request id (a request leaves when it is GONE).
        cancelled: request ids cancelled recently, known here or not: a job or handoff for them is refused.
        bus: the connection's watch (None until started): tells a reconnect's settling time.
        accepting: False once the node drains (its heartbeats say so; jobs are refused ``draining``).
        draining: True once it drains.
    """

    cfg: AgentConfig
    model: LatencyModel
    backend: EngineBackend
    log: Any
    tracer: Any
    metrics: AgentMetrics
    origin: OriginGuard
    tasks: BackgroundTasks
    clock: Clock = SYSTEM_CLOCK
    nc: Any = None
    bus: Any = None
    accepting: bool = True
    epoch_unix_ms: float = 0.0  #: this incarnation (the agent's start, wall ms): on JobAck, KvAck
    draining: bool = False  #: the node drains (its heartbeats say so; it exits when done: kairos/services/node_agent/drain.py)
    reqs: dict[str, NodeRequest] = field(default_factory=dict)
    cancelled: RecentIds = field(default_factory=lambda: RecentIds(CANCELLED_REMEMBERED))

    @property
    def node(self) -> str:
        return self.cfg.node_id

    def out_subject(self, rid: str) -> str:
        """This agent's out subject of ``rid`` (``kairos.out.<rid>.agent-<node>``: the bus proves the sender)."""
        return S.out_subject(rid, agent_user(self.cfg.node_id))

    def rlog(self, rid: str, span: Any = None) -> Any:
        """The logger for lines about ``rid``: request id and trace id bound (the span or context
        given, else the request's main span)."""
        if span is None:
            span = spans_of(self.reqs.get(rid)).main
        return self.log.bind(request_id=rid, **telemetry.trace_fields(span))
