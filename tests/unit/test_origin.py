"""Who sent a bus message (kairos/contracts/origin.py): the subject the bus proves, never the body; a
JetStream delivery is nobody's. Refusals are counted per kind and logged; nothing else is."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kairos.contracts.origin import OriginGuard, forged_counter

METRIC = "kairos_ingress_forged_messages_total"
#: the kinds docs/observability lists for the counter (kairos/contracts/origin.py FORGED_KINDS), written out
KINDS = ("heartbeat", "step_record", "out_event", "kv_handoff", "kv_done", "job")


@dataclass
class Msg:
    """The two attributes of a nats-py ``Msg`` the guard reads."""

    subject: str
    headers: dict | None = None


@dataclass
class Log:
    warnings: list = field(default_factory=list)

    def warning(self, event: str, **kw) -> None:
        self.warnings.append((event, kw))


def guard() -> tuple[OriginGuard, CollectorRegistry, Log]:
    reg, log = CollectorRegistry(), Log()
    return OriginGuard(forged_counter("ingress", reg), log), reg, log


def count(reg: CollectorRegistry, kind: str) -> float | None:
    return reg.get_sample_value(METRIC, {"kind": kind})


def test_the_counter_is_named_for_the_service_and_starts_every_kind_at_zero():
    reg = CollectorRegistry()
    forged_counter("aggregator", reg)
    for k in KINDS:  # present before the first refusal, so a dashboard sees 0, not "no data"
        assert reg.get_sample_value("kairos_aggregator_forged_messages_total", {"kind": k}) == 0.0
    assert reg.get_sample_value(METRIC, {"kind": "heartbeat"}) is None  # another service's name
    # /metrics renders it, with a description (prometheus_client fails to render a counter without one)
    help_line = next(x for x in generate_latest(reg).decode().splitlines()
                     if x.startswith("# HELP kairos_aggregator_forged_messages_total "))
    assert help_line.removeprefix("# HELP kairos_aggregator_forged_messages_total ").strip()


@pytest.mark.parametrize("headers", [None, {}, {"Nats-Msg-Id": "abc"}])
@pytest.mark.parametrize("claimed", ["decode-0", None])
def test_a_message_on_its_senders_subject_is_accepted_silently(headers, claimed):
    g, reg, log = guard()
    assert g.check(Msg("kairos.state.decode-0", headers), "heartbeat", "decode-0", claimed) is True
    assert log.warnings == [] and all(count(reg, k) == 0.0 for k in KINDS)


@pytest.mark.parametrize("headers, proven, claimed, reason", [
    # a stream's answer (DIRECT.GET to a forged reply subject), even when subject and body agree
    ({"Nats-Stream": "KV_kairos_requests"}, "decode-0", "decode-0", "jetstream"),
    ({"Nats-Stream": "KV_kairos_requests"}, None, None, "jetstream"),  # the stream header decides first
    (None, None, "decode-0", "foreign_subject"),  # the subject names no node
    ({}, None, None, "foreign_subject"),
    (None, "decode-0", "decode-1", "names_another_node"),  # decode-0 posing as decode-1
    ({"Nats-Msg-Id": "abc"}, "decode-0", "ghost-9", "names_another_node"),
])
def test_a_refused_message_is_counted_once_under_its_kind_and_logged(headers, proven, claimed, reason):
    g, reg, log = guard()
    assert g.check(Msg("kairos.state.decode-0", headers), "kv_done", proven, claimed, request_id="r-1") is False
    assert count(reg, "kv_done") == 1.0  # 0 + 1
    assert all(count(reg, k) == 0.0 for k in KINDS if k != "kv_done")
    assert log.warnings == [("forged_message_refused", {
        "kind": "kv_done", "reason": reason, "subject": "kairos.state.decode-0", "sender": proven,
        "claimed_node": claimed, "request_id": "r-1"})]


def test_refuse_counts_and_logs_the_callers_own_reason():
    g, reg, log = guard()
    g.refuse("kairos.out.r-2.agent-decode-0", "out_event", "not_the_jobs_node", "agent-decode-0", "decode-1",
             request_id="r-2", event_type="TokenEvent")
    g.refuse("kairos.out.r-2.agent-decode-0", "out_event", "not_the_jobs_node", "agent-decode-0", "decode-1",
             request_id="r-2", event_type="TokenEvent")
    assert count(reg, "out_event") == 2.0  # two refusals, 1 each
    assert log.warnings[0] == ("forged_message_refused", {
        "kind": "out_event", "reason": "not_the_jobs_node", "subject": "kairos.out.r-2.agent-decode-0",
        "sender": "agent-decode-0", "claimed_node": "decode-1", "request_id": "r-2", "event_type": "TokenEvent"})
    assert len(log.warnings) == 2
