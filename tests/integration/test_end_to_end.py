"""ingress → dispatcher → agent(s) → tokens, for the keep and the deflect path, streaming and not."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import components_known, get_record, stack, wait_until

pytestmark = pytest.mark.integration


def sse_payloads(events: list[str]) -> list[dict]:
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


async def test_keep_path_non_streaming(nats_url):
    async with stack(nats_url, policy="pd") as st:
        status, body = await st.complete("the quick brown fox " * 50, max_tokens=5)
        assert status == 200, body
        assert body["object"] == "text_completion"
        assert body["usage"] == {"prompt_tokens": 250, "completion_tokens": 5, "total_tokens": 255,
                                 "prompt_tokens_details": {"cached_tokens": 0}}
        assert body["choices"][0]["finish_reason"] == "length"
        assert len(body["choices"][0]["text"].split()) == 5
        rec = await get_record(st, body["id"], components_known)
        assert rec["decision"] == "keep" and rec["node"].startswith("prefill-") and rec["policy"] == "pd"
        assert rec["records"]["prefill"]["handoff_node"] == rec["decode_node"]
        m = rec["measured"]
        assert m["prefill_exec_ms"] > 0 and m["kv_transfer_ms"] > 0
        assert m["ttft_ms"] >= m["prefill_exec_ms"] + m["kv_transfer_ms"]


async def test_keep_path_streaming_chat(nats_url):
    async with stack(nats_url, policy="pd") as st:
        status, events = await st.complete("hi there", max_tokens=6, stream=True, chat=True,
                                           stream_options={"include_usage": True})
        assert status == 200, events
        chunks = sse_payloads(events)
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # as OpenAI and vLLM
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])
        content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        assert len([c for c in content if c]) == 6
        finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
        assert finals and finals[-1]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_deflect_path_streaming(nats_url):
    # sl:100000 deflects every prompt shorter than 100000 tokens (static χ = 128, §3.4)
    async with stack(nats_url, policy="sl:100000") as st:
        ids = list(range(1, 601))  # token-id prompt: counted exactly
        status, events = await st.complete(ids, max_tokens=4, stream=True)
        assert status == 200, events
        chunks = sse_payloads(events)
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["text"]]
        assert len(texts) == 4
        rid = chunks[0]["id"]
        rec = await get_record(st, rid, components_known)
        assert rec["decision"] == "deflect" and rec["node"].startswith("decode-")
        assert rec["chunk_schedule"] and all(c == 128 for c in rec["chunk_schedule"])
        m = rec["measured"]
        assert m["kv_transfer_ms"] == 0 and m["decode_queue_ms"] == 0
        assert len(m["chunk_sizes"]) == len(m["chunk_actual_ms"]) == len(m["chunk_predicted_ms"]) >= 5
        assert rec["records"]["ingress"]["prompt_tokens"] == 600
        # the node published a reservation for the deflection and released it when the prefill finished
        await wait_until(lambda: all(rid not in {r.request_id for r in d.reservations.values()}
                                     and rid not in d.state.pending_deflections for d in st.dispatchers), 5,
                         "the reservation released")
        assert all(a.deflecting == {} for a in st.agents.values())


async def test_kairos_policy_decision_record(nats_url):
    # an idle cluster: Algorithm 1 estimates both paths; the prefill node wins (keep_alpha_margin)
    async with stack(nats_url, policy="kairos") as st:
        status, body = await st.complete("short prompt " * 20, max_tokens=3)
        assert status == 200, body
        rec = await get_record(st, body["id"], components_known)
        assert rec["policy"] == "kairos"
        assert rec["decision"] == "keep" and rec["reason"] == "keep_alpha_margin", rec
        assert set(rec["estimates"]["ttft_decode_est_ms"]) == {"decode-0", "decode-1"}
        assert rec["reason"] and rec["estimates"]["ttft_prefill_est_ms"] is not None
        assert rec["routing"]["state_age_ms"] is not None
