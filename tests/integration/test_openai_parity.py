"""Issue 20 through the real stack (ingress → NATS → dispatcher → emulated agents), keep and deflect
paths: completions ``echo`` (also with ``max_tokens: 0`` and streaming) and the
``X-Kairos-Ignored-Params`` header naming what was accepted and ignored."""

from __future__ import annotations

import pytest

from kairos.core.engine_model.text import token_text
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
