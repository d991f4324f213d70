"""The fan-out of ``n`` > 1 / batched prompts (kairos/services/ingress/fanout.py): sub-requests as
vLLM indexes them, and every fanned-out request ends with a completion or an explicit error — one
failing sub-request fails the request and stops its siblings (``sibling_failed``: the client did not
leave)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from kairos.contracts.errors import ErrorCode
from kairos.contracts.permissions import agent_user
from kairos.contracts.events import ErrorEvent, TokenEvent
from kairos.runtime.clock import ManualClock
from kairos.services.ingress.fanout import STOP_SOURCE, FanOut, expand, run_all
from kairos.services.ingress.http import error_response
from kairos.services.ingress.lifecycle import RequestLifecycle
from kairos.services.ingress.openai_api.parse import prepare_request
from kairos.services.ingress.openai_api.responses import ApiError
from tests.unit.test_ingress_relay import WAIT_S, post, stack  # noqa: F401  (stack: fixture)


def fanned(**kw):
    parsed, pt, exact = prepare_request("completions", {"model": "m", "max_tokens": 2, **kw}, ["m"], None, 4096)
    return parsed, expand(parsed, pt, exact, None, 4096)


def test_expand_indexes_seeds_and_prompts_as_vllm():
    parsed, subs = fanned(prompt=["aaaa", "bbbbbbbb"], n=3, seed=10)
    assert [s.index for s in subs] == list(range(6))
    assert [s.prompt_idx for s in subs] == [0, 0, 0, 1, 1, 1]
    assert [s.parsed.sampling.seed for s in subs] == [10, 11, 12] * 2  # vLLM: child j gets seed + j
    assert [s.parsed.prompt_text for s in subs] == ["aaaa"] * 3 + ["bbbbbbbb"] * 3
    assert [s.prompt_tokens for s in subs] == [1] * 3 + [2] * 3
    assert all(s.parsed.n == 1 and s.parsed.more_prompts == () for s in subs)


def test_a_seed_whose_last_choice_overflows_int64_is_refused():
    """Choice j samples with seed + j (vLLM's parallel sampling); vLLM's HTTP server, which Kairos'
    vLLM engines are, takes seeds up to 2**63 - 1 only: the last choice's seed must fit."""
    top = 2**63 - 1
    assert [s.parsed.sampling.seed for s in fanned(prompt="a", n=3, seed=top - 2)[1]] == [top - 2, top - 1, top]
    with pytest.raises(ApiError) as ei:
        fanned(prompt="a", n=3, seed=top - 1)
    assert ei.value.status == 400 and ei.value.param == "seed" and ei.value.code == ErrorCode.INVALID_VALUE
    assert str(top) in ei.value.message and "seed + j" in ei.value.message
    assert fanned(prompt="a", n=2, seed=-(2**63))[1][1].parsed.sampling.seed == -(2**63) + 1  # the low end is fine


class FakeRelay:
    """A relay whose sub-request either completes, fails, or waits until it is stopped (then ends
    with the stop's error, as :class:`~kairos.services.ingress.relay.RequestRelay` does)."""

    def __init__(self, answer, behaviour: str, rid: str) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.lc, self.clock = RequestLifecycle(rid=rid), ManualClock()
        self.answer = answer(lambda: None)
        self.behaviour = behaviour
        self.stopped = False

    async def run(self):
        a = self.answer
        if self.behaviour == "complete":
            await a.tokens(TokenEvent(request_id="r", first_index=0, count=1, text="x", node="n", sent_unix_ms=0.0),
                           True, lambda: True)
            return await a.complete("length", 1, 1, 0)
        if self.behaviour == "fail":
            await asyncio.sleep(0)  # the sibling is waiting by now
            return await a.error(502, ErrorCode.ENGINE_ERROR, "engine died")
        if self.behaviour == "enqueue_failed":
            return error_response(ErrorCode.ENQUEUE_FAILED, "could not enqueue", status=503), 503
        stop = await self.queue.get()  # waits until stopped
        assert isinstance(stop, ErrorEvent) and stop.request_id == self.lc.attempt_id, stop
        self.stopped = stop
        return await a.error(stop.status, stop.code, stop.message)


async def outcome(behaviours: list[str]):
    parsed, subs = fanned(prompt="aaaa", n=len(behaviours))
    fan = FanOut(None, parsed, "cmpl-x", 0, {}, subs)  # type: ignore[arg-type]  (non-streaming: no HTTP writes)
    relays = {s.index: FakeRelay(fan.answer(s.index), b, f"sub-{s.index}") for s, b in zip(subs, behaviours)}
    resp, status = await run_all(fan, relays)
    return resp, status, relays, fan


async def test_all_complete_merges_choices_and_usage():
    resp, status, _, _ = await outcome(["complete", "complete"])
    body = orjson.loads(resp.body)
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 1 and body["usage"]["completion_tokens"] == 2  # prompt once


async def test_a_failing_sub_request_fails_the_request_and_stops_the_others():
    resp, status, relays, fan = await outcome(["wait", "fail", "wait"])
    assert status == 502 and orjson.loads(resp.body)["error"]["code"] == "engine_error"
    for i in (0, 2):
        assert relays[i].stopped.code == ErrorCode.SIBLING_FAILED and relays[i].stopped.source == STOP_SOURCE
        assert relays[i].stopped.message == "choice 1 of request cmpl-x failed (engine_error): this choice was cancelled"
    assert fan.statuses == {0: 424, 1: 502, 2: 424}  # each its own: the siblings' is not the client's 499


async def test_an_error_answered_by_the_relay_itself_fails_the_request():
    resp, status, relays, fan = await outcome(["enqueue_failed", "wait"])
    assert status == 503 and orjson.loads(resp.body)["error"]["code"] == "enqueue_failed"
    # the code the failure is known by (the stops' message, an SSE error event's code) is the answer's own,
    # one of the catalogue (docs/errors.md)
    assert fan.failed_by == (0, "enqueue_failed")
    assert relays[1].stopped.message == "choice 0 of request cmpl-x failed (enqueue_failed): this choice was cancelled"


async def test_siblings_stopped_by_a_failing_choice_are_recorded_as_such_not_as_a_client_that_left(stack):
    """Through the real relays (the fake bus of test_ingress_relay): choice 1 of an ``n`` = 2 request
    fails on its node; choice 0 is cancelled on its node with the truthful cause ``sibling_failed``
    (not ``client_disconnected``: the client is still there and gets choice 1's error), and its
    record, ``GET /v1/requests/<id>``, the disconnect counter and ``kairos:request_success`` say so."""
    st = stack
    answer = post(st, max_tokens=4, n=2, seed=1)
    subs = sorted([(await st.bus.published()).request_id for _ in range(2)])
    for i, sid in enumerate(subs):
        await st.routed(sid, f"decode-{i}")
    await st.out(agent_user("decode-1"), ErrorEvent(request_id=subs[1], status=502, code=ErrorCode.ENGINE_ERROR,
                                                    message="engine died", source="node_agent:decode-1",
                                                    sent_unix_ms=st.clock.now_ms()))
    status, headers, body = await asyncio.wait_for(answer, WAIT_S)
    assert status == 502 and orjson.loads(body)["error"]["code"] == "engine_error", body
    headers_ids = headers["X-Kairos-Sub-Request-Ids"].split(",")  # in choice order
    assert sorted(headers_ids) == subs
    failed, stopped = subs[1], subs[0]
    assert sorted(st.bus.cancels) == sorted([(failed, "engine_error"), (stopped, "sibling_failed")])
    rec = await st.record(stopped)
    assert rec.status == ErrorCode.SIBLING_FAILED.status and rec.error == "sibling_failed", rec
    assert str(headers_ids.index(failed)) in (rec.error_message or ""), rec  # names the choice that failed
    assert (await st.record(failed)).error == "engine_error"
    async with st.http.get(f"{st.base}/v1/requests/{stopped}") as r:
        ingress = (await r.json())["records"]["ingress"]
    assert ingress["status"] == ErrorCode.SIBLING_FAILED.status and ingress["error"] == "sibling_failed", ingress
    assert st.ing.m.disconnects.labels("completions", "false")._value.get() == 0  # nobody disconnected
    success = st.ing.m.vllm.success
    assert success["abort"]._value.get() == 1 and success["error"]._value.get() == 1  # vLLM: an aborted sequence


async def test_a_siblings_late_token_is_dropped_and_a_resubmitted_sibling_is_stopped_again():
    """Between a failure and a sibling reading its stop: a token of the sibling is dropped (not taken
    for a client that left, which would record 499), and a sibling re-submitted meanwhile (its node
    lost: the first stop names its old attempt) is stopped again under its new attempt."""
    parsed, subs = fanned(prompt="aaaa", n=2)
    fan = FanOut(None, parsed, "cmpl-x", 0, {}, subs)  # type: ignore[arg-type]  (non-streaming: no HTTP writes)
    stops: list[int] = []
    fan.stop = stops.append
    sibling, failing = fan.answer(0)(lambda: None), fan.answer(1)(lambda: None)
    await failing.error(502, ErrorCode.ENGINE_ERROR, "engine died")
    assert stops == [0] and fan.failed_by == (1, "engine_error")
    tok = TokenEvent(request_id="r", first_index=0, count=1, text="x", node="n", sent_unix_ms=0.0)
    assert await sibling.tokens(tok, True, lambda: True) is True
    assert fan.choices[0].text == []
    sibling.discard()  # the relay re-submits it
    assert stops == [0, 0]
    failing.discard()  # (the failed one never is; were it, it is not stopped)
    assert stops == [0, 0]
