"""The dispatcher's routing of one request (kairos/services/dispatcher/route.py) with fakes: no NATS.

The router gets a fake job link (scripted :class:`JobAck` answers per try, as the request's ingress
relays them — the node's, or the ingress's own ``no_responders`` / ``timeout`` / ``cancelled`` — or
:class:`IngressGone`), a recording
publish/record writer, a :class:`~kairos.runtime.clock.ManualClock` and a view of two prefill and two
decode nodes. Each test checks what went on the bus (jobs, routing event, decision record, error
event) and the metrics. The same protocol on a real nats-server: tests/integration/test_cluster.py,
test_bus_faults.py, test_job_relay.py.
"""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from kairos.contracts import subjects as S
from kairos.contracts.errors import ErrorCode
from kairos.contracts.permissions import DISPATCHER
from kairos.contracts.events import ErrorEvent
from kairos.contracts.wire import (JOB_CANCELLED, JOB_NO_RESPONDERS, JOB_UNANSWERED, ClusterView, decode, encode,
                                   InferenceRequest, Job, JobAck, NodeView, RoutedEvent)
from kairos.contracts.records import DecisionRecord
from kairos.core.model.latency import load_profile
from kairos.core.policy import parse_policy
from kairos.runtime.clock import ManualClock
from kairos.services.dispatcher.busretry import BUS_RETRY_FIRST_WAIT_S
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.jobs import IngressGone
from kairos.services.dispatcher.metrics import DispatcherMetrics
from kairos.services.dispatcher.outcome import Outcomes
from kairos.services.dispatcher.route import Router
from kairos.services.dispatcher.state import RoutingState

NODES = (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"))
ACCEPT = "accept"
DUPLICATE = "duplicate"  #: accepted: the node runs it already (a copy sent again reached it)


class FakeLink:
    """Answers each job by ``script(node, try_number)``: ACCEPT, a refusal reason, or an exception to raise."""

    def __init__(self, clock: ManualClock, script) -> None:
        self.clock, self.script = clock, script
        self.sent: list[tuple[str, Job]] = []
        self.via: list[str] = []

    async def request(self, node: str, job: Job, via: str) -> JobAck:
        self.sent.append((node, job))
        self.via.append(via)
        answer = self.script(node, len(self.sent))
        if isinstance(answer, Exception):
            raise answer
        if answer == ACCEPT:
            return JobAck(accepted=True, node=node, accepted_unix_ms=self.clock.now_ms())
        if answer == DUPLICATE:
            return JobAck(accepted=True, node=node, reason="duplicate", accepted_unix_ms=self.clock.now_ms())
        return JobAck(accepted=False, node=node, reason=answer)

    async def send_unanswered(self, node: str, job: Job, via: str) -> None:
        raise AssertionError("only the fault tier sends a job without waiting for its answer")

    def connected(self) -> bool:
        return True

    def settling(self, window_s: float) -> bool:
        return False


class Bus:
    """What the router published (subject, message) and the records it wrote (key -> bytes)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []
        self.records: dict[str, bytes] = {}

    async def publish(self, subject: str, msg) -> None:
        self.published.append((subject, msg))

    async def put_record(self, key: str, value: bytes, if_absent: bool = False) -> None:
        if not (if_absent and key in self.records):  # as the stream does with its expected sequence 0
            self.records[key] = value

    def of(self, kind: type) -> list:
        return [m for _, m in self.published if isinstance(m, kind)]


class Span:
    def __init__(self) -> None:
        self.attributes: dict = {}
        self.events: list[str] = []

    def set_attribute(self, key, value) -> None:
        self.attributes[key] = value

    def set_attributes(self, attrs) -> None:
        self.attributes.update(attrs)

    def add_event(self, name, attributes=None) -> None:
        self.events.append(name)

    def set_status(self, status) -> None:
        self.status = status

    def is_recording(self) -> bool:  # an exported span: its attributes are built
        return True


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def _log(self, event, **kw) -> None:
        self.events.append((event, kw))

    info = warning = error = debug = _log

    def bind(self, **_kw) -> "Log":
        return self


class Msg:
    def __init__(self) -> None:
        self.progress = 0
        self.notices = "_INBOX.ingress.x.cmpl-1"  #: the attempt's conversation subject at its ingress

    async def in_progress(self) -> None:
        self.progress += 1


class Setup:
    def __init__(self, script, policy: str = "pd", **cfg) -> None:
        self.clock = ManualClock()
        self.cfg = DispatcherConfig(policy=policy, metrics_port=-1, replica_id="dispatcher-t", **cfg)
        self.state = RoutingState(clock=self.clock)
        now = self.clock.now_ms()
        self.state.take_view(encode(ClusterView(seq=1, built_unix_ms=now, period_ms=100.0, stale_after_ms=300.0, nodes=[
            NodeView(node=n, role=r, stale=False, age_ms=5.0, state_sent_unix_ms=now) for n, r in NODES])))
        self.m = DispatcherMetrics(CollectorRegistry())
        self.bus, self.log, self.span, self.msg = Bus(), Log(), Span(), Msg()
        self.link = FakeLink(self.clock, script)
        self.outcomes = Outcomes(self.cfg.replica_id, policy, self.m, self.bus.publish, self.bus.put_record,
                                 self.log, self.clock)
        self.router = Router(self.cfg, self.state, self.link, self.outcomes, self.m, parse_policy(policy),
                             load_profile(), clock=self.clock)
        self.req = InferenceRequest(request_id="cmpl-1", model="m", prompt_tokens=256, max_tokens=8,
                                    created_unix_ms=now, deadline_unix_ms=now + 30_000.0)

    async def route(self) -> None:
        await self.router.route(self.req, self.msg, self.span, self.log)

    def record(self) -> DecisionRecord:
        return decode(self.bus.records[S.record_key(self.req.request_id, "decision")], DecisionRecord)

    def count(self, metric, *labels) -> float:
        return (metric.labels(*labels) if labels else metric)._value.get()


def only_routed(s: Setup) -> RoutedEvent:
    (ev,) = s.bus.of(RoutedEvent)
    assert not s.bus.of(ErrorEvent)
    return ev


async def test_a_job_accepted_at_the_first_try_is_routed_there():
    s = Setup(lambda node, n: ACCEPT)
    await s.route()
    (node, job), = s.link.sent
    assert node.startswith("prefill-") and job.kind == "keep" and job.attempt == 0 and job.request == s.req
    assert s.link.via == [s.msg.notices]  # handed to the request's ingress, which sends it
    assert job.predicted_ttft_ms is not None and job.predicted_ttft_ms > 0  # the ingress records it
    ev = only_routed(s)
    assert (ev.request_id, ev.node, ev.kind, ev.lane) == ("cmpl-1", node, "keep", None)  # no request lanes
    rec = s.record()
    assert (rec.node, rec.attempts, rec.excluded_nodes, rec.reservation_conflicts) == (node, 1, {}, [])
    assert s.outcomes.routed == 1 and s.count(s.m.decisions, "pd", "keep", "pd_never_deflects") == 1
    assert s.span.attributes["kairos.outcome"] == "routed" and s.msg.progress == 0


async def test_a_duplicate_is_published_again_but_not_counted_nor_recorded_over_the_first_routing():
    """A copy sent again reaches the node already running the request: its routing event goes out
    (the first replica may have died before sending it), no decision is counted, and the decision
    record of the first routing stays (the helper's finding: a stale copy rewrote it)."""
    s = Setup(lambda node, n: DUPLICATE)
    first = b'{"first": true}'
    s.bus.records[S.record_key("cmpl-1", "decision")] = first
    await s.route()
    assert only_routed(s).request_id == "cmpl-1"
    assert s.bus.records[S.record_key("cmpl-1", "decision")] == first
    assert s.count(s.m.duplicates) == 1 and s.outcomes.routed == 0
    assert s.count(s.m.decisions, "pd", "keep", "pd_never_deflects") == 0
    fresh = Setup(lambda node, n: DUPLICATE)  # no record yet (the first replica died before writing it)
    await fresh.route()
    assert fresh.record().node == only_routed(fresh).node


async def test_a_refused_job_is_routed_again_elsewhere_and_the_refusing_node_excluded():
    s = Setup(lambda node, n: "draining" if n == 1 else ACCEPT)
    await s.route()
    (first, _), (second, job) = s.link.sent
    assert second != first and second.startswith("prefill-") and job.attempt == 1
    assert only_routed(s).node == second
    assert s.record().excluded_nodes == {first: "draining"} and s.record().attempts == 2
    assert s.count(s.m.reroutes, "draining") == 1


async def test_a_deflection_refused_for_want_of_a_slot_goes_to_another_decode_node():
    """``deflection_in_flight``: the node is shown full (not excluded) and the policy decides again."""
    s = Setup(lambda node, n: "deflection_in_flight" if n == 1 else ACCEPT, policy="sl:100000")
    await s.route()
    (first, job1), (second, job2) = s.link.sent
    assert job1.kind == "deflect" and first.startswith("decode-") and second != first
    # the refused node's slot is given back here; the accepted one is held until its reservation is watched
    assert [r.decode_node for r in s.state.pending_deflections.values()] == [second]
    assert only_routed(s).node == second
    rec = s.record()
    assert rec.reservation_conflicts == [first] and rec.excluded_nodes == {}
    assert s.count(s.m.conflicts, "node_refused") == 1 and s.count(s.m.reroutes, "deflection_in_flight") == 1


async def test_every_node_refusing_ends_the_request_with_no_available_node():
    s = Setup(lambda node, n: "draining")
    await s.route()
    assert sorted(node for node, _ in s.link.sent) == ["prefill-0", "prefill-1"]  # each tried once
    (err,) = s.bus.of(ErrorEvent)
    assert (err.code, err.status) == (ErrorCode.NO_AVAILABLE_NODE, 503) == (err.code, err.code.status)
    assert err.request_id == "cmpl-1" and err.source == "dispatcher:dispatcher-t"
    assert s.bus.published[-1][0] == S.out_subject("cmpl-1", DISPATCHER)
    assert not s.bus.of(RoutedEvent) and S.record_key("cmpl-1", "decision") not in s.bus.records
    assert s.count(s.m.errors, "no_available_node") == 1 and s.span.attributes["kairos.outcome"] == "no_available_node"


async def test_no_agent_for_the_job_is_retried_on_the_same_node_without_excluding_it():
    s = Setup(lambda node, n: JOB_NO_RESPONDERS if n == 1 else ACCEPT)
    await s.route()
    (first, job1), (second, job2) = s.link.sent
    assert second == first and (job1.attempt, job2.attempt) == (0, 1)
    assert only_routed(s).node == first
    assert s.record().excluded_nodes == {}
    assert s.clock.slept == [BUS_RETRY_FIRST_WAIT_S]  # one backoff, on the router's clock
    assert s.msg.progress == 1  # the ingress hears that the routing goes on
    assert s.count(s.m.bus_retries, "no_responders") == 1 and s.count(s.m.reroutes, "no_responders") == 0


@pytest.mark.parametrize("answer, outcome", [(JOB_UNANSWERED, "moved"), (JOB_CANCELLED, "cancelled"),
                                             (IngressGone("gone"), "ingress_gone")])
async def test_the_ingress_ending_or_moving_the_attempt_ends_the_routing_without_an_event(answer, outcome):
    """The node did not answer the ingress in time (it may run the job: the ingress moves the attempt
    under a new id), the ingress sent no job, or the ingress is gone: routed nowhere, no error either."""
    s = Setup(lambda node, n: answer, policy="sl:100000")
    await s.route()
    assert len(s.link.sent) == 1 and s.bus.published == [] and s.bus.records == {}
    assert s.span.attributes["kairos.outcome"] == outcome and "cmpl-1" in s.state.cancelled
    assert not s.state.pending_deflections  # the deflection's slot is given back here


async def test_a_bus_fault_past_the_retry_budget_excludes_the_node():
    s = Setup(lambda node, n: JOB_NO_RESPONDERS if n == 1 else ACCEPT, bus_retry_s=0.0)
    await s.route()
    (first, _), (second, _) = s.link.sent
    assert second != first and s.record().excluded_nodes == {first: "no_responders"}
    assert s.clock.slept == [] and s.count(s.m.bus_retries, "no_responders") == 0


async def test_a_request_cancelled_before_its_job_sends_nothing():
    s = Setup(lambda node, n: ACCEPT)
    s.state.cancelled.add("cmpl-1")
    await s.route()
    assert s.link.sent == [] and s.bus.published == [] and s.span.attributes["kairos.outcome"] == "cancelled"
