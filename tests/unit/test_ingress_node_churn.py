"""The ingress's judgement of nodes its requests depend on (issue 33), with the fake bus and the manual
clock of tests/unit/test_ingress_relay.py: the test plays the dispatchers and node agents, heartbeats
included, and runs the watchers' checks itself.

Each test pins one of the ways a request hangs or is cut for nothing when a node churns:

* on the keep path, a decode node that took the KV dies (or restarts) before its first token while
  its prefill node lives: the request must be re-submitted within seconds, not wait for the idle
  timeout's 504;
* a node whose heartbeats stop reaching the ingress while its tokens flow is alive: its streams go on;
* a restarted agent (a later epoch in its heartbeat) lost what its previous incarnation held, even
  when its first heartbeat is read before the ingress ever checked the request.
"""

from __future__ import annotations

import asyncio

import orjson

from kairos.contracts import subjects as S
from kairos.contracts.events import HandoffEvent, TokenEvent
from kairos.contracts.permissions import agent_user
from kairos.contracts.wire import NodeState, encode
from tests.unit.test_ingress_relay import WAIT_S, Msg, post, sse_payloads, stack  # noqa: F401  (the fixture)

E1, E2 = 1_699_999_940_000.0, 1_699_999_999_000.0  #: two incarnations' epochs: started 60 s and 1 s before the clock


class Nodes:
    """Heartbeats of the test's nodes, each with its epoch and seq."""

    def __init__(self, st) -> None:
        self.st, self.seq = st, {}

    async def beat(self, node: str, epoch: float = E1, role: str = "decode") -> None:
        key = (node, epoch)
        self.seq[key] = self.seq.get(key, 0) + 1
        st = NodeState(node=node, role=role, seq=self.seq[key], sent_unix_ms=self.st.clock.now_ms(),
                       epoch_unix_ms=epoch, period_ms=100.0)
        await self.st.ing.watch.on_state(Msg(S.state_subject(node), encode(st)))


async def routed(st, attempt: str, node: str, kind: str, epoch: float) -> None:
    await st.routed(attempt, node, kind, epoch)


async def test_a_keep_path_decode_node_dying_before_its_first_token_resubmits_at_once(stack):
    """prefill-0 keeps heartbeating; decode-1, which took the KV (its HandoffEvent), goes silent:
    after the liveness timeout the request is re-submitted (within seconds, not the 60 s idle
    timeout's 504)."""
    st, nodes = stack, Nodes(stack)
    answer = post(st, max_tokens=2, stream=True)
    rid = (await st.bus.published()).request_id
    await nodes.beat("prefill-0", role="prefill")
    await nodes.beat("decode-1")
    await routed(st, rid, "prefill-0", "keep", E1)
    await st.out(agent_user("prefill-0"), HandoffEvent(request_id=rid, node="prefill-0", decode_node="decode-1",
                                                       sent_unix_ms=st.clock.now_ms(), decode_epoch_unix_ms=E1))
    for _ in range(int(st.ing.cfg.liveness_timeout_s / 0.5) + 2):  # 0.5 s steps: prefill-0 speaks, decode-1 not
        st.clock.advance(0.5)
        await nodes.beat("prefill-0", role="prefill")
        st.ing.watch.check()
    again = await asyncio.wait_for(st.bus.published(), WAIT_S)
    assert again.request_id == f"{rid}-r1", again
    assert (rid, "resubmitted") in st.bus.cancels
    answer.cancel()


async def test_a_restart_read_before_any_check_still_loses_the_old_incarnations_request(stack):
    """decode-0 accepted the deflection as incarnation E1 (the routing event says so) and restarted:
    its first heartbeat as E2 arrives before the ingress checks the request. The request is lost with
    E1 and re-submitted; recording the epoch at the first check would have taken E2 for the one
    that accepted it, and the request would have waited for the idle timeout."""
    st, nodes = stack, Nodes(stack)
    answer = post(st, max_tokens=2, stream=True)
    rid = (await st.bus.published()).request_id
    await nodes.beat("decode-0", E1)
    await routed(st, rid, "decode-0", "deflect", E1)
    await nodes.beat("decode-0", E2)  # the new incarnation, read before any check
    st.ing.watch.check()
    again = await asyncio.wait_for(st.bus.published(), WAIT_S)
    assert again.request_id == f"{rid}-r1"
    answer.cancel()


async def test_tokens_are_a_sign_of_life_when_heartbeats_do_not_arrive(stack):
    """decode-0's heartbeats stop reaching the ingress (refused, or late on a loaded bus) while its
    tokens flow, and prefill-0 keeps heartbeating (the ingress is not deaf): its stream is not cut."""
    st, nodes = stack, Nodes(stack)
    answer = post(st, max_tokens=20, stream=True)
    rid = (await st.bus.published()).request_id
    await nodes.beat("decode-0")
    await nodes.beat("prefill-0", role="prefill")
    await routed(st, rid, "decode-0", "deflect", E1)
    for i in range(20):  # 10 s of tokens, no heartbeat of decode-0
        st.clock.advance(0.5)
        await nodes.beat("prefill-0", role="prefill")
        await st.out(agent_user("decode-0"), TokenEvent(request_id=rid, first_index=i, count=1, text=f" w{i}",
                                                        node="decode-0", sent_unix_ms=st.clock.now_ms(),
                                                        finish_reason="length" if i == 19 else None))
        st.ing.watch.check()
    assert st.bus.enqueued.empty() and not any(r == "resubmitted" or r == "migrated" for _, r in st.bus.cancels)
    from kairos.contracts.events import DoneEvent
    await st.out(agent_user("decode-0"), DoneEvent(request_id=rid, completion_tokens=20, node="decode-0",
                                                   sent_unix_ms=st.clock.now_ms()))
    status, _, body = await asyncio.wait_for(answer, WAIT_S)
    assert status == 200 and b'"error"' not in body and body.count(b" w") == 20
    assert orjson.loads(body.split(b"data: ")[1].split(b"\n")[0])["id"]


async def test_late_tokens_of_a_moved_attempt_are_dropped_counted_and_their_node_told_to_stop_once(stack):
    """Fencing (issue 33): decode-0 was paused past the liveness timeout, its stream moved to decode-1.
    Resumed, decode-0 still streams the old attempt: its tokens never reach the client, they are
    counted (``old_attempt``), not taken for forgeries, and the first one gets decode-0 a cancel of
    that attempt (the one it missed while paused) — one, not one per token."""
    st, nodes = stack, Nodes(stack)
    answer = post(st, max_tokens=4, stream=True)
    rid = (await st.bus.published()).request_id
    await nodes.beat("decode-0")
    await nodes.beat("decode-1")
    await routed(st, rid, "decode-0", "deflect", E1)
    await st.out(agent_user("decode-0"), TokenEvent(request_id=rid, first_index=0, count=1, text=" a",
                                                    node="decode-0", sent_unix_ms=st.clock.now_ms()))
    for _ in range(int(st.ing.cfg.liveness_timeout_s / 0.5) + 2):  # decode-0 paused, decode-1 speaks
        st.clock.advance(0.5)
        await nodes.beat("decode-1")
        st.ing.watch.check()
    cont = await asyncio.wait_for(st.bus.published(), WAIT_S)
    assert cont.request_id == f"{rid}-m1" and cont.resume is not None and cont.resume.output_tokens == 1
    dropped = st.ing.m.dropped.labels("old_attempt")._value.get()
    forged = st.ing.origin.counter.labels("out_event")._value.get()
    before = list(st.bus.cancels)
    for i in (1, 2, 3):  # the resumed node's late tokens of the old attempt
        await st.out(agent_user("decode-0"), TokenEvent(request_id=rid, first_index=i, count=1, text=f" late{i}",
                                                        node="decode-0", sent_unix_ms=st.clock.now_ms()))
    await st.ing.bg.wait_all()
    assert st.bus.cancels[len(before):] == [(rid, "superseded")]  # once
    assert st.ing.m.dropped.labels("old_attempt")._value.get() == dropped + 3
    assert st.ing.origin.counter.labels("out_event")._value.get() == forged
    await routed(st, cont.request_id, "decode-1", "deflect", E1)
    for i, text in enumerate([" b", " c", " d"]):
        await st.out(agent_user("decode-1"), TokenEvent(request_id=cont.request_id, first_index=i, count=1, text=text,
                                                        node="decode-1", sent_unix_ms=st.clock.now_ms(),
                                                        finish_reason="length" if i == 2 else None))
    from kairos.contracts.events import DoneEvent
    await st.out(agent_user("decode-1"), DoneEvent(request_id=cont.request_id, completion_tokens=3, node="decode-1",
                                                   sent_unix_ms=st.clock.now_ms()))
    status, _, body = await asyncio.wait_for(answer, WAIT_S)
    texts = [c["choices"][0]["text"] for c in sse_payloads(body)[:-1]]
    assert status == 200 and texts == [" a", " b", " c", " d"], texts
