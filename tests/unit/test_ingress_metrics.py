"""The ingress's vLLM-named request metrics (``kairos:*``, docs/metrics.md), scraped from ``GET /metrics``.

Driven through real HTTP with the fake bus and manual clock of :mod:`tests.unit.test_ingress_relay`
(the test plays the dispatchers and nodes), so every latency is exact: the clock moves only when
the test advances it. The families must be vLLM 0.32's (vllm/v1/metrics/loggers.py) under the
``kairos:`` prefix, with its label names and buckets (vllm/v1/metrics/buckets.py).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kairos.contracts.errors import ErrorCode
from kairos.contracts.permissions import agent_user
from kairos.contracts.events import DoneEvent, ErrorEvent, TokenEvent
from kairos.runtime.telemetry import metric_names
from kairos.services.ingress import metrics as M
from kairos.services.ingress.config import IngressConfig
from kairos.services.ingress.metrics import FINISHED_REASONS, request_tokens_buckets
from kairos.services.ingress.service import Ingress
from tests.unit.test_ingress_relay import MODEL, WAIT_S, Stack, post, stack  # noqa: F401 (stack: fixture)

#: vLLM 0.32's request-level families: name (after the prefix) -> Prometheus type
FAMILIES = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "prompt_tokens": "counter", "generation_tokens": "counter", "prompt_tokens_cached": "counter",
    "prefix_cache_queries": "counter", "prefix_cache_hits": "counter", "request_success": "counter",
    "time_to_first_token_seconds": "histogram", "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_time_per_output_token_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "request_prompt_tokens": "histogram",
    "request_generation_tokens": "histogram", "request_prefill_kv_computed_tokens": "histogram",
}
#: the kairos:* families vLLM has no counterpart of, and their extra labels (besides model_name, engine)
KAIROS_ONLY = {"request_migrations": ("counter", {"reason"})}
#: vllm/v1/metrics/buckets.py (0.32): top finite bucket and bucket count of each timing family
TOPS = {"time_to_first_token_seconds": (2560.0, 22), "inter_token_latency_seconds": (80.0, 19),
        "request_time_per_output_token_seconds": (80.0, 19), "e2e_request_latency_seconds": (7680.0, 21),
        "request_decode_time_seconds": (7680.0, 21)}


async def scrape(st: Stack) -> dict[str, Any]:
    """``GET /metrics`` parsed: family name -> its prometheus_client ``Metric``."""
    async with st.http.get(st.base + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    # the text format's ``<name>_created`` samples parse as families of their own (vLLM's too)
    return {f.name: f for f in text_string_to_metric_families(text)
            if f.name.startswith("kairos:") and not f.name.endswith("_created")}


def value(fams: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    """The one sample ``kairos:<name><suffix>`` with ``labels`` (plus model_name and engine)."""
    want = {"model_name": MODEL, "engine": "ingress-0", **labels}
    hits = [s.value for s in fams["kairos:" + name].samples
            if s.name == "kairos:" + name + suffix and s.labels == want]
    assert len(hits) == 1, (name, suffix, labels)
    return hits[0]


async def relayed(st: Stack, n: int) -> None:
    """Until the relay has handled ``n`` tokens in all (it reads its queue in its own task; the clock
    must not move before it stamps a token). Polls each loop turn; ``WAIT_S`` is a safety net."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while st.ing.m.vllm.generation_tokens._value.get() < n:
        assert loop.time() < deadline, f"the relay never handled {n} tokens"
        await asyncio.sleep(0)


def token(rid: str, i: int, st: Stack, node: str = "decode-0") -> TokenEvent:
    return TokenEvent(request_id=rid, first_index=i, count=1, text=f"t{i}", node=node, sent_unix_ms=st.clock.now_ms())


def done(rid: str, n: int, st: Stack, reason: str = "length", cached: int = 0) -> DoneEvent:
    return DoneEvent(request_id=rid, completion_tokens=n, finish_reason=reason, cached_tokens=cached, node="decode-0",
                     sent_unix_ms=st.clock.now_ms())


async def test_families_labels_and_buckets_are_vllms_before_any_request(stack):
    fams = await scrape(stack)
    assert {n.removeprefix("kairos:"): f.type for n, f in fams.items()} == {
        **FAMILIES, **{n: t for n, (t, _) in KAIROS_ONLY.items()}}
    for name, fam in fams.items():
        for s in fam.samples:
            extra = {"finished_reason"} if name == "kairos:request_success" else set()
            extra |= KAIROS_ONLY.get(name.removeprefix("kairos:"), ("", set()))[1]
            extra |= {"le"} if s.name.endswith("_bucket") else set()
            assert set(s.labels) == {"model_name", "engine"} | extra, s
            assert (s.labels["model_name"], s.labels["engine"]) == (MODEL, "ingress-0")
    reasons = {s.labels["finished_reason"] for s in fams["kairos:request_success"].samples}
    assert reasons == set(FINISHED_REASONS) == {"stop", "length", "abort", "error", "repetition"}
    for name, (top, count) in TOPS.items():
        les = [s.labels["le"] for s in fams["kairos:" + name].samples if s.name.endswith("_bucket")]
        assert les[-1] == "+Inf" and float(les[-2]) == top and len(les) == count + 1, name
    # token counts: vLLM's 1-2-5 series up to max_model_len
    mml = stack.ing.max_model_len
    les = [float(s.labels["le"]) for s in fams["kairos:request_prompt_tokens"].samples
           if s.name.endswith("_bucket")][:-1]
    assert les == request_tokens_buckets(mml) and les[:7] == [1, 2, 5, 10, 20, 50, 100] and les[-1] <= mml


def test_request_token_buckets_are_the_1_2_5_series():
    assert request_tokens_buckets(100) == [1, 2, 5, 10, 20, 50, 100]  # vllm's build_1_2_5_buckets doctest
    assert request_tokens_buckets(4096)[-1] == 2000
    with pytest.raises(ValueError, match="max_model_len"):
        request_tokens_buckets(0)


async def test_a_streamed_request_is_waiting_then_running_and_its_timings_are_exact(stack):
    st = stack
    chunks: asyncio.Queue = asyncio.Queue()

    async def client() -> int:
        async with st.http.post(st.base + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3, 4],
                                                                   "max_tokens": 3, "stream": True}) as r:
            async for block in r.content.iter_chunked(1 << 16):
                chunks.put_nowait(block)
            return r.status

    answer = asyncio.ensure_future(client())
    rid = (await st.bus.published()).request_id
    await st.routed(rid, "decode-0")
    fams = await scrape(st)
    assert (value(fams, "num_requests_waiting"), value(fams, "num_requests_running")) == (1, 0)
    node = agent_user("decode-0")
    st.clock.advance(0.25)
    await st.out(node, token(rid, 0, st))
    await asyncio.wait_for(chunks.get(), WAIT_S)  # the first token reached the client
    await relayed(st, 1)
    fams = await scrape(st)
    assert (value(fams, "num_requests_waiting"), value(fams, "num_requests_running")) == (0, 1)
    assert value(fams, "time_to_first_token_seconds", "_count") == 1
    assert value(fams, "time_to_first_token_seconds", "_sum") == pytest.approx(0.25)
    assert value(fams, "prompt_tokens", "_total") == 4  # the prompt was prefilled
    for i, gap in ((1, 0.04), (2, 0.06)):
        st.clock.advance(gap)
        await st.out(node, token(rid, i, st))
        await relayed(st, i + 1)
    st.clock.advance(0.01)
    await st.out(node, done(rid, 3, st, reason="stop", cached=2))
    assert await asyncio.wait_for(answer, WAIT_S) == 200
    await st.ing.bg.wait_all()  # the end is observed with the ingress record
    fams = await scrape(st)
    assert (value(fams, "num_requests_waiting"), value(fams, "num_requests_running")) == (0, 0)
    assert value(fams, "inter_token_latency_seconds", "_count") == 2
    assert value(fams, "inter_token_latency_seconds", "_sum") == pytest.approx(0.10)
    assert value(fams, "inter_token_latency_seconds", "_bucket", le="0.05") == 1  # 40 ms in, 60 ms out
    reg = st.ing.tel.registry  # Kairos' own TTFT / TBT families observe the same gaps
    assert reg.get_sample_value("kairos_ingress_ttft_seconds_sum") == pytest.approx(0.25)
    assert reg.get_sample_value("kairos_ingress_tbt_seconds_count") == 2
    assert reg.get_sample_value("kairos_ingress_tbt_seconds_sum") == pytest.approx(0.10)
    assert value(fams, "e2e_request_latency_seconds", "_sum") == pytest.approx(0.36)
    assert value(fams, "request_decode_time_seconds", "_sum") == pytest.approx(0.11)
    assert value(fams, "request_time_per_output_token_seconds", "_sum") == pytest.approx(0.055)
    assert value(fams, "generation_tokens", "_total") == 3
    assert value(fams, "request_success", "_total", finished_reason="stop") == 1
    assert sum(value(fams, "request_success", "_total", finished_reason=r) for r in FINISHED_REASONS) == 1
    assert (value(fams, "request_prompt_tokens", "_sum"), value(fams, "request_generation_tokens", "_sum")) == (4, 3)
    assert value(fams, "prefix_cache_queries", "_total") == 4 and value(fams, "prefix_cache_hits", "_total") == 2
    assert value(fams, "prompt_tokens_cached", "_total") == 2
    assert value(fams, "request_prefill_kv_computed_tokens", "_sum") == 2


async def test_usage_totals_equal_the_token_counters_and_errors_count_as_error(stack):
    st = stack
    node = agent_user("decode-0")
    usages = []
    for n, prompt in ((2, [5, 6]), (1, [7, 8, 9, 10, 11])):
        answer = post(st, max_tokens=n, prompt=prompt)
        rid = (await st.bus.published()).request_id
        await st.routed(rid, "decode-0")
        for i in range(n):
            st.clock.advance(0.1)
            await st.out(node, token(rid, i, st))
            await relayed(st, sum(u["completion_tokens"] for u in usages) + i + 1)
        await st.out(node, done(rid, n, st, cached=1))
        status, _h, body = await asyncio.wait_for(answer, WAIT_S)
        assert status == 200
        usages.append(orjson.loads(body)["usage"])
    # an accepted request answered with an error before its first token
    answer = post(st, max_tokens=2)
    rid = (await st.bus.published()).request_id
    await st.routed(rid, "decode-0")
    await st.out(node, ErrorEvent(request_id=rid, status=500, code=ErrorCode.ENGINE_ERROR, message="it failed",
                                  source="node_agent:decode-0", sent_unix_ms=st.clock.now_ms()))
    assert (await asyncio.wait_for(answer, WAIT_S))[0] == 500
    # refused by validation: never accepted, not a request of these families
    assert (await asyncio.wait_for(post(st, max_tokens=-1), WAIT_S))[0] == 400
    await st.ing.bg.wait_all()
    fams = await scrape(st)
    assert value(fams, "prompt_tokens", "_total") == sum(u["prompt_tokens"] for u in usages) == 7
    assert value(fams, "generation_tokens", "_total") == sum(u["completion_tokens"] for u in usages) == 3
    assert value(fams, "prefix_cache_hits", "_total") == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                              for u in usages) == 2
    assert value(fams, "request_success", "_total", finished_reason="length") == 2
    assert value(fams, "request_success", "_total", finished_reason="error") == 1
    assert value(fams, "time_to_first_token_seconds", "_count") == 2  # the failed one had no first token
    assert value(fams, "e2e_request_latency_seconds", "_count") == 3
    assert value(fams, "request_prompt_tokens", "_sum") == 7 + 3  # the failed request's prompt too
    assert value(fams, "request_prompt_tokens", "_count") == 3
    assert value(fams, "prefix_cache_queries", "_total") == 7  # answered requests only (their usage says)
    assert value(fams, "inter_token_latency_seconds", "_count") == 1


def test_docs_table_lists_exactly_the_families_with_their_types_and_labels():
    """docs/metrics.md's table against the registry (names, types, label names), and its bucket ranges."""
    ing = Ingress(IngressConfig())
    try:
        reg = metric_names(ing.tel.registry, prefix="kairos:")
    finally:
        ing.tel.shutdown()
    families: dict[str, tuple[str, set[str]]] = {}
    for name, (typ, labels) in reg.items():
        base = re.sub(r"_(bucket|sum|count|total)$", "", name) if typ in ("histogram", "counter") else name
        families[base] = (typ, set(labels) - {"le"})
    text = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `kairos:")]
    documented = {re.fullmatch(r"`(kairos:[a-z0-9_]+)`", r[0]).group(1): (r[1], set(re.findall(r"`([a-z_]+)`", r[2])))
                  for r in rows}
    assert documented == families
    assert set(families) == {"kairos:" + n for n in (*FAMILIES, *KAIROS_ONLY)}
    # the bucket ranges the docs give are the code's
    for buckets in (M.TIME_TO_FIRST_TOKEN_BUCKETS, M.INTER_TOKEN_LATENCY_BUCKETS, M.REQUEST_LATENCY_BUCKETS):
        assert f"`{buckets[0]:g}` s to `{buckets[-1]:g}` s" in text
