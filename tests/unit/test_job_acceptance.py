"""A node agent's answer to a job (kairos/services/node_agent/jobs.py ``Jobs.on_job``), with no bus:
the agent runs a job it accepts at once — no claim is made anywhere (issue 34: the request's ingress
sends no other job of the attempt while this one may run, kairos/core/cluster/arbiter.py) — answers a
second job of a request it holds ``duplicate`` without running it again, refuses one whose request
was cancelled or that its engine refuses, and publishes nothing on the way."""

from __future__ import annotations

import io
import json
import sys

import pytest

from kairos.services.node_agent.agent import NodeAgent
from kairos.services.node_agent.config import AgentConfig
from kairos.contracts import subjects as S
from kairos.runtime import telemetry
from kairos.contracts.events import OutEvent
from kairos.contracts.wire import decode, encode, InferenceRequest, Job, JobAck, now_ms


def job(rid: str = "req-1", kind: str = "keep", node: str = "prefill-0",
        candidates: tuple[str, ...] = ("decode-1", "decode-0"), dispatcher: str = "d-a", attempt: int = 2,
        prompt_tokens: int = 64) -> Job:
    req = InferenceRequest(request_id=rid, model="m", prompt_tokens=prompt_tokens, max_tokens=3,
                           created_unix_ms=now_ms(), deadline_unix_ms=now_ms() + 60_000)
    return Job(kind=kind, request=req, node=node, decode_candidates=list(candidates), dispatcher_id=dispatcher,
               attempt=attempt)


# -- the node agent answers a job ------------------------------------------------------------------
class Msg:
    """A job request as nats-py delivers it to the agent's subscription (a reply subject, no headers)."""

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject, self.data, self.reply, self.headers = subject, data, "_INBOX.test", None
        self.answers: list[JobAck] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(decode(data, JobAck))


class Bus:
    """The agent's connection, as far as an out event goes: what it published, decoded."""

    def __init__(self) -> None:
        self.published: list[tuple[str, OutEvent]] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        self.published.append((subject, decode(payload, OutEvent)))


@pytest.fixture
def logs():
    """The JSON log lines written while the test runs (configured before the agent binds its logger;
    afterwards logging goes to this session's stderr again, not to a stream a test session closed)."""
    buf = io.StringIO()
    telemetry.configure_logging("info", "json", stream=buf)
    yield lambda: [json.loads(x) for x in buf.getvalue().splitlines()]
    telemetry.configure_logging("info", "json", stream=sys.stderr)


@pytest.fixture
def agent(logs):
    a = NodeAgent(AgentConfig(node_id="prefill-0", role="prefill"))  # constructed, never started: no bus
    a.nc = Bus()
    yield a
    a.tel.shutdown()


async def submit(agent: NodeAgent, j: Job) -> JobAck:
    msg = Msg(S.jobs_subject(agent.cfg.node_id), encode(j))
    await agent._on_job(msg)
    assert len(msg.answers) == 1
    return msg.answers[0]


async def test_the_agent_runs_a_job_at_once_and_answers_with_its_incarnation(agent):
    ack = await submit(agent, job("runs-here"))
    assert ack.accepted and ack.reason == "" and ack.node == "prefill-0"
    assert ack.epoch_unix_ms == agent.epoch_unix_ms and ack.accepted_unix_ms > 0
    assert "runs-here" in agent.reqs and agent.backend.phase("runs-here") is not None  # the engine has it
    assert agent.nc.published == []  # nothing written or published on the way (no claim)


async def test_a_second_job_of_a_request_the_node_holds_is_a_duplicate_and_does_not_run_again(agent, logs):
    first = await submit(agent, job("twice"))
    added = []
    agent.backend.add_prefill = lambda req: added.append(req.request_id)  # a second run would reach the engine
    again = await submit(agent, job("twice", dispatcher="d-b", attempt=3))
    assert first.accepted and again.accepted and again.reason == "duplicate" and added == []
    assert [x["event"] for x in logs() if x.get("request_id") == "twice"][-1] == "job_duplicate"


async def test_a_job_of_a_cancelled_request_or_one_its_engine_refuses_is_refused_and_never_runs(agent):
    agent.cancelled.add("gone")
    ack = await submit(agent, job("gone"))
    assert (ack.accepted, ack.reason) == (False, "cancelled") and agent.backend.phase("gone") is None

    def refuse(req):
        raise ValueError("no room")
    agent.backend.add_prefill = refuse
    ack = await submit(agent, job("refused"))
    assert not ack.accepted and ack.reason == "engine_refused: no room" and "refused" not in agent.reqs


async def test_a_job_for_another_node_or_role_is_refused_before_the_engine(agent):
    ack = await submit(agent, job("elsewhere", node="prefill-1"))
    assert not ack.accepted and "elsewhere" not in agent.reqs and agent.backend.phase("elsewhere") is None
    ack = await submit(agent, job("wrong-role", kind="deflect", candidates=()))
    assert not ack.accepted and ack.reason == "wrong_role" and "wrong-role" not in agent.reqs
