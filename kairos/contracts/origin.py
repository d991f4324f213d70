"""Who sent a bus message: the subject the bus let the sender publish on, never the body.

Where it comes from: nats-server checks every PUB against the sender's permissions
(:mod:`kairos.contracts.permissions`): only ``agent-<node>`` may publish ``kairos.state.<node>``,
``kairos.steps.<node>``, ``kairos.out.<rid>.agent-<node>``, ``kairos.kv.<decode>.agent-<node>``
and ``kairos.kvdone.<prefill>.agent-<node>``. So a consumer takes the sender's node id from the subject and
refuses a body that names another node (``forged``): counted per kind in
``kairos_<service>_forged_messages_total{kind}`` and logged as ``forged_message_refused`` with the
subject and the node the body named. With no bus credentials (``--no-nats-auth``) the subject is
only as good as the body, but the check costs nothing.

JetStream deliveries are never taken for a node's message (``jetstream``): the server publishes
them on a role's behalf without checking the consumer's ``deliver_subject`` or a request's reply
subject against the creator's permissions (nats-server 2.15, tests/integration/test_bus_origin.py).
A push or pull delivery keeps the stream's own subject (``$KV.…``), which no
per-node subject matches; a ``DIRECT.GET`` answer sent to a forged reply subject carries the
``Nats-Stream`` header, refused here.
"""

from __future__ import annotations

from prometheus_client import Counter

#: what a refused message was (metric label values)
FORGED_KINDS = ("heartbeat", "step_record", "out_event", "kv_handoff", "kv_done", "job", "drain")
#: header nats-server puts on every message it answers from a stream (DIRECT.GET, MSG.GET)
STREAM_HEADER = "Nats-Stream"


def forged_counter(service: str, registry) -> Counter:
    """``kairos_<service>_forged_messages_total{kind}``, every kind of :data:`FORGED_KINDS` at 0."""
    c = Counter(f"kairos_{service}_forged_messages_total",
                "Bus messages refused because the body named another sender than the subject the bus let it "  # pragma: no mutate
                "publish on, because that sender may not send it (an out event from a node the request's job did "  # pragma: no mutate
                "not go to), or because JetStream delivered them, by kind",  # pragma: no mutate
                ("kind",), registry=registry)
    for k in FORGED_KINDS:
        c.labels(k)
    return c


class OriginGuard:
    """Refuses (counts and logs) messages whose claimed sender is not the one the bus proves.

    Args:
        counter: :func:`forged_counter` of the service.
        log: the service's structured logger.
    """

    def __init__(self, counter: Counter, log) -> None:
        self.counter, self.log = counter, log

    def check(self, msg, kind: str, proven: str | None, claimed: str | None, **fields) -> bool:
        """True when ``msg`` (a nats-py ``Msg``) came from ``proven`` (the node its subject names;
        None: the subject names none) and its body names the same node ``claimed`` (None: the
        body names none, nothing to compare). Otherwise count it as ``kind`` (one of
        :data:`FORGED_KINDS`), log ``forged_message_refused`` with ``fields`` and return False."""
        if msg.headers and STREAM_HEADER in msg.headers:
            reason = "jetstream"
        elif proven is None:
            reason = "foreign_subject"
        elif claimed is not None and claimed != proven:
            reason = "names_another_node"
        else:
            return True
        self.refuse(msg.subject, kind, reason, proven, claimed, **fields)
        return False

    def refuse(self, subject: str, kind: str, reason: str, sender: str | None, claimed: str | None,
               **fields) -> None:
        """Count and log one refused message (``subject`` it came on, ``sender`` the subject proves,
        ``claimed`` the node its body names) for a ``reason`` of the caller's own."""
        self.counter.labels(kind).inc()
        self.log.warning("forged_message_refused", kind=kind, reason=reason, subject=subject,
                         sender=sender, claimed_node=claimed, **fields)
