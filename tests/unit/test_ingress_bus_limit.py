"""A request must fit one NATS message (``max_payload``; kairos/services/ingress/completions.py
``check_bus_payload``): a prompt over that limit is refused, 400 ``prompt_too_large`` naming the
limit and the prompt's parameter, before the tokenizer counts it (a 16 MB prompt costs it seconds),
on both completion endpoints; a prompt under it is still counted.

Driven through real HTTP with the fake bus of :mod:`tests.unit.test_ingress_relay` (its
``max_payload`` set small) and a tokenizer that records what it is asked to count."""

from __future__ import annotations

import asyncio

import orjson

from tests.unit.test_ingress_relay import MODEL, WAIT_S, Stack, stack  # noqa: F401 (stack: fixture)

LIMIT = 64 * 1024  #: the fake bus's max_payload (bytes)


class SpyCounter:
    """A tokenizer (``counter(text, add_special_tokens)``: the estimate) that records the sizes it counted."""

    def __init__(self) -> None:
        self.counted: list[int] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> int:
        self.counted.append(len(text))
        return max(1, len(text.encode()) // 4)


async def answer(st: Stack, path: str, body: dict) -> tuple[int, dict]:
    async with st.http.post(st.base + path, json={"model": MODEL, **body}) as r:
        return r.status, orjson.loads(await r.read())


def spied(st: Stack) -> SpyCounter:
    spy = SpyCounter()
    assert st.ing.completions is not None
    st.ing.completions.counter = spy
    st.bus.max_payload = LIMIT
    return spy


async def test_a_prompt_over_the_bus_limit_is_refused_before_it_is_tokenized(stack):
    st = stack
    spy = spied(st)
    huge = "word " * 20_000  # 100 kB
    for path, body, param, subject in [
        ("/v1/completions", {"prompt": huge, "max_tokens": 4}, "prompt", "The prompt is"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 4}, "messages",
         "The messages are"),  # plural: not 'The messages is'
    ]:
        status, out = await asyncio.wait_for(answer(st, path, body), WAIT_S)
        err = out["error"]
        assert status == 400 and err["code"] == "prompt_too_large" and err["param"] == param, out
        assert err["message"].startswith(f"{subject} too large to route: the request takes "), err
        assert err["message"].endswith(f"Shorten the {param}."), err
        assert f"whose limit (NATS max_payload) is {LIMIT} bytes" in err["message"], err
        assert spy.counted == [], f"{path}: the tokenizer counted {spy.counted} characters of a prompt it refused"


async def test_a_prompt_under_the_bus_limit_is_still_counted_by_the_tokenizer(stack):
    st = stack
    spy = spied(st)
    publish = asyncio.ensure_future(answer(st, "/v1/completions", {"prompt": "word " * 100, "max_tokens": 4}))
    req = await st.bus.published()  # accepted and enqueued: the test does not serve it
    assert req.prompt_tokens == 125 and req.prompt_tokens_exact
    assert spy.counted == [500]
    publish.cancel()


async def test_every_prompt_of_a_batch_must_fit_the_bus(stack):
    """Each prompt of a batched completions request is its own bus message (kairos/services/ingress/fanout.py):
    a later prompt over the limit is refused as the first would be (not published, to fail at the bus as a
    retryable 503 ``enqueue_failed``), before the tokenizer counts anything."""
    st = stack
    spy = spied(st)
    huge = "word " * 20_000
    status, out = await asyncio.wait_for(answer(st, "/v1/completions", {"prompt": ["hello", huge], "max_tokens": 4}),
                                         WAIT_S)
    assert status == 400 and out["error"]["code"] == "prompt_too_large" and out["error"]["param"] == "prompt", out
    assert spy.counted == []
    assert st.bus.enqueued.empty()
