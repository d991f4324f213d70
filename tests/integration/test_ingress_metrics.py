"""The ingress's vLLM-named metrics (``kairos:*``, docs/metrics.md) against a real nats-server and
emulated engines: requests driven through the whole stack (keep and deflect, streamed and not,
completions and chat, a repeated prompt the prefix cache serves), then ``GET /metrics`` parsed
with ``prometheus_client.parser``. Every count and sum must equal what the answers said."""

from __future__ import annotations

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kairos.services.ingress.metrics import FINISHED_REASONS
from tests.integration.conftest import stack
from tests.integration.test_telemetry import poll

pytestmark = pytest.mark.integration

MODEL = "kairos-emulated"


async def scrape(st) -> dict[str, list]:
    """Sample name -> [(labels, value)] of the ingress's ``kairos:*`` samples."""
    async with st.http.get(f"{st.base}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kairos:"):
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get("kairos:" + name, []) if all(lab.get(k) == x for k, x in labels.items()))


def usage_of(status: int, body, stream: bool) -> tuple[dict, str]:
    """(usage, finish_reason) of an answer; a stream's from its usage chunk and last choice."""
    assert status == 200, body
    if not stream:
        return body["usage"], body["choices"][0]["finish_reason"]
    chunks = [orjson.loads(e) for e in body if e != "[DONE]"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1 and reasons[-1] is not None, chunks
    return usage[0], reasons[-1]


async def test_counts_and_sums_equal_what_the_answers_said(nats_url):
    prompt = "the quick brown fox jumps over the lazy dog " * 40  # asked three times: the cache serves it
    asks = [dict(prompt=prompt, max_tokens=3), dict(prompt=prompt, max_tokens=5, stream=True),
            dict(prompt=prompt, max_tokens=2, chat=True), dict(prompt=[7] * 3000, max_tokens=4, stream=True),
            dict(prompt="hello world", max_tokens=1), dict(prompt="a short one", max_tokens=6, chat=True, stream=True)]
    async with stack(nats_url, policy="kairos+") as st:
        empty = await scrape(st)
        assert total(empty, "time_to_first_token_seconds_count") == 0
        answers = []
        for ask in asks:
            stream = ask.get("stream", False)
            extra = {"stream_options": {"include_usage": True}} if stream else {}
            answers.append(usage_of(*await st.complete(**ask, **extra), stream))
        n = len(asks)

        async def all_finished():  # observed as each request's ingress record is written (background)
            s = await scrape(st)
            return s if total(s, "request_success_total") == n else None

        s = await poll(all_finished, 5, "every request's end observed")

    lab = {"model_name": MODEL, "engine": "ingress-0"}
    for name, samples in s.items():  # every sample carries vLLM's labels
        assert all({k: lb[k] for k in lab} == lab for lb, _v in samples), name
    prompt_sum = sum(u["prompt_tokens"] for u, _r in answers)
    gen_sum = sum(u["completion_tokens"] for u, _r in answers)
    cached_sum = sum(u["prompt_tokens_details"]["cached_tokens"] for u, _r in answers)
    assert cached_sum > 0  # the repeated prompt was served from a prefix cache
    assert total(s, "prompt_tokens_total") == prompt_sum == total(s, "request_prompt_tokens_sum")
    assert total(s, "generation_tokens_total") == gen_sum == total(s, "request_generation_tokens_sum")
    assert total(s, "prefix_cache_queries_total") == prompt_sum
    assert total(s, "prefix_cache_hits_total") == cached_sum == total(s, "prompt_tokens_cached_total")
    assert total(s, "request_prefill_kv_computed_tokens_sum") == prompt_sum - cached_sum
    for reason in FINISHED_REASONS:
        assert total(s, "request_success_total", finished_reason=reason) == sum(r == reason for _u, r in answers)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_time_per_output_token_seconds", "request_decode_time_seconds"):
        assert total(s, name + "_count") == n, name
    # the emulated engines emit one token per step, so one inter-token latency per later token
    assert total(s, "inter_token_latency_seconds_count") == gen_sum - n
    assert total(s, "time_to_first_token_seconds_sum") + total(s, "inter_token_latency_seconds_sum") <= (
        total(s, "e2e_request_latency_seconds_sum") + 1e-9)
    ttft_les = [lb["le"] for lb, _v in s["kairos:time_to_first_token_seconds_bucket"]]
    assert ttft_les[-2:] == ["2560.0", "+Inf"]
    assert total(s, "time_to_first_token_seconds_bucket", le="+Inf") == n
    assert total(s, "num_requests_running") == 0 and total(s, "num_requests_waiting") == 0
    assert "kairos:num_requests_running" in empty and "kairos:num_requests_waiting" in empty

