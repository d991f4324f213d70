"""Issue 20 through the real stack (ingress → NATS → dispatcher → emulated agents), keep and deflect
paths: completions ``echo`` (also with ``max_tokens: 0`` and streaming), the
``X-Kairos-Ignored-Params`` header naming what was accepted and ignored, and each choice's
``stop_reason`` (vLLM's: the stop string or stop token id that ended it)."""

from __future__ import annotations

import pytest

from kairos.contracts.wire import SamplingParams
from kairos.core.engine_model.text import emulated_completion, token_text
from tests.integration.conftest import post_openai as post, stack

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("policy", ["pd", "sl:100000"])  # keep path, deflect path
async def test_echo(nats_url, policy):
    async with stack(nats_url, policy=policy) as st:
        req = {"prompt": "alpha beta", "max_tokens": 6, "seed": 3}
        status, _, plain = await post(st, req)
        assert status == 200, plain
        text = plain["choices"][0]["text"]
        status, _, echo = await post(st, {**req, "echo": True})
        assert status == 200, echo
        assert echo["choices"][0]["text"] == "alpha beta" + text
        assert echo["usage"] == plain["usage"]  # echo changes no counts (vLLM)
        status, _, chunks = await post(st, {**req, "echo": True, "stream": True})
        assert status == 200, chunks
        assert chunks[0]["choices"][0]["text"].startswith("alpha beta")
        assert "".join(c["choices"][0]["text"] for c in chunks) == "alpha beta" + text
        status, _, only = await post(st, {**req, "echo": True, "max_tokens": 0})
        assert status == 200, only
        ch = only["choices"][0]
        assert (ch["text"], ch["finish_reason"], only["usage"]["completion_tokens"]) == ("alpha beta", "length", 1)
        status, _, ids = await post(st, {"prompt": [5, 6], "max_tokens": 2, "echo": True})
        assert status == 200 and ids["choices"][0]["text"].startswith(token_text(5) + token_text(6)), ids


@pytest.mark.parametrize("policy", ["pd", "sl:100000"])
async def test_ignored_parameters_are_named_in_a_header(nats_url, policy):
    async with stack(nats_url, policy=policy) as st:
        msgs = [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "a custom role"}]
        body = {"messages": msgs, "max_tokens": 3, "store": True, "metadata": {"team": "x"},
                "parallel_tool_calls": False, "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "none"}
        status, headers, out = await post(st, body, chat=True)
        assert status == 200, out
        assert headers["X-Kairos-Ignored-Params"] == "store,metadata"
        status, headers, chunks = await post(st, {**body, "stream": True, "reasoning_effort": "low"}, chat=True)
        assert status == 200, chunks
        assert headers["X-Kairos-Ignored-Params"] == "store,metadata,reasoning_effort"
        status, headers, out = await post(st, {"messages": msgs, "max_tokens": 3, "store": False}, chat=True)
        assert status == 200 and "X-Kairos-Ignored-Params" not in headers, out
        status, _, err = await post(st, {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]})
        assert status == 400 and err["error"]["param"] == "stop", err
        # structured output needs vLLM engines: this stack's are emulated, and the ingress knows it
        status, _, err = await post(st, {"prompt": "x", "response_format": {"type": "json_object"}})
        assert status == 400 and err["error"]["param"] == "response_format", err


def finishing(chunks: list[dict], chat: bool) -> dict[int, object]:
    """Per choice index: the ``stop_reason`` of its chunk with the ``finish_reason`` (checked: one such
    chunk per choice; the others carry ``stop_reason: null`` (completions) or none (chat), as vLLM's)."""
    out: dict[int, object] = {}
    for c in chunks:
        for ch in c["choices"]:
            if ch["finish_reason"] is None:
                assert ("stop_reason" not in ch) if chat else (ch["stop_reason"] is None), ch
                continue
            assert ch["index"] not in out and "stop_reason" in ch, ch
            out[ch["index"]] = ch["stop_reason"]
    return out


@pytest.mark.parametrize("policy", ["pd", "sl:100000"])  # keep path, deflect path
async def test_stop_reason_is_the_stop_string_or_token_id_that_ended_each_choice(nats_url, policy):
    """vLLM 0.32's per-choice ``stop_reason``, non-streamed and streamed, completions and chat, n > 1
    and batched prompts. Truth: the stop string asked for, and the emulated engine's token ids (its
    output is a function of the seed, :mod:`kairos.core.engine_model.text`)."""
    n = 12
    ids = [emulated_completion(SamplingParams(seed=7), n, None, None).token_id(i) for i in range(n)]
    async with stack(nats_url, policy=policy) as st:
        status, _, free = await post(st, {"prompt": "alpha beta", "max_tokens": n, "seed": 7})
        assert status == 200 and free["choices"][0]["finish_reason"] == "length", free
        word = free["choices"][0]["text"].split()[4]
        cases = [({"stop": ["never-a-word", word]}, word, "stop"), ({"stop_token_ids": [ids[3]]}, ids[3], "stop"),
                 ({}, None, "length")]
        for chat in (False, True):
            prompt = {"messages": [{"role": "user", "content": "alpha"}]} if chat else {"prompt": "alpha beta"}
            for extra, reason, finish in cases:
                body = {**prompt, "max_tokens": n, "seed": 7, **extra}
                status, _, out = await post(st, body, chat=chat)
                assert status == 200, out
                ch = out["choices"][0]
                assert (ch["finish_reason"], ch["stop_reason"]) == (finish, reason) and "stop_reason" in ch, ch
                status, _, chunks = await post(st, {**body, "stream": True}, chat=chat)
                assert status == 200 and finishing(chunks, chat) == {0: reason}, chunks
        # fan-out: n = 2 (choice j samples with seed + j) and two prompts x n = 2, each choice its own
        stop = {"stop_token_ids": [ids[3]]}
        want = [emulated_completion(SamplingParams(seed=7 + j, **stop), n, None, None).stop_reason for j in (0, 1)]
        assert want[0] == ids[3]
        status, _, out = await post(st, {"prompt": "alpha beta", "max_tokens": n, "seed": 7, "n": 2, **stop})
        assert status == 200 and [c["stop_reason"] for c in out["choices"]] == want, out
        status, _, chunks = await post(st, {"messages": [{"role": "user", "content": "alpha"}], "max_tokens": n,
                                            "seed": 7, "n": 2, "stream": True, **stop}, chat=True)
        assert status == 200 and finishing(chunks, True) == dict(enumerate(want)), chunks
        status, _, chunks = await post(st, {"prompt": ["alpha", "beta gamma"], "max_tokens": n, "seed": 7, "n": 2,
                                            "stream": True, **stop})
        assert status == 200 and finishing(chunks, False) == dict(enumerate(want + want)), chunks
