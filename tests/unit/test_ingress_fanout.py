"""The fan-out of ``n`` > 1 / batched prompts (kairos/services/ingress/fanout.py): sub-requests as
vLLM indexes them, and every fanned-out request ends with a completion or an explicit error — one
failing sub-request fails the request and stops its siblings (cancelled as a client that left)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from kairos.contracts.errors import ErrorCode
from kairos.contracts.wire import TokenEvent
from kairos.services.ingress.fanout import FanOut, expand, run_all
from kairos.services.ingress.flights import ClientGone
from kairos.services.ingress.http import error_response
from kairos.services.ingress.openai_api.parse import prepare_request
from kairos.services.ingress.openai_api.responses import ApiError


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
    """A relay whose sub-request either completes, fails, or waits until it is stopped."""

    def __init__(self, answer, behaviour: str) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
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
        assert isinstance(await self.queue.get(), ClientGone)  # waits until stopped
        self.stopped = True
        return a.gone()


async def outcome(behaviours: list[str]):
    parsed, subs = fanned(prompt="aaaa", n=len(behaviours))
    fan = FanOut(None, parsed, "cmpl-x", 0, {}, subs)  # type: ignore[arg-type]  (non-streaming: no HTTP writes)
    relays = {s.index: FakeRelay(fan.answer(s.index), b) for s, b in zip(subs, behaviours)}
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
    assert relays[0].stopped and relays[2].stopped
    assert fan.statuses == {0: 499, 1: 502, 2: 499}


async def test_an_error_answered_by_the_relay_itself_fails_the_request():
    resp, status, relays, _ = await outcome(["enqueue_failed", "wait"])
    assert status == 503 and orjson.loads(resp.body)["error"]["code"] == "enqueue_failed"
    assert relays[1].stopped
