"""ingress → dispatcher → agent(s) → tokens, for the keep and the deflect path, streaming and not."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import stack

pytestmark = pytest.mark.integration


async def test_keep_path_non_streaming(nats_url):
    async with stack(nats_url, policy="pd") as st:
        status, body = await st.complete("the quick brown fox " * 50, max_tokens=5)
        assert status == 200, body
        assert body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] == 5
        assert body["usage"]["prompt_tokens"] > 0
        assert body["choices"][0]["finish_reason"] == "length"
        rid = body["id"]
        async with st.http.get(f"{st.base}/v1/requests/{rid}") as r:
            rec = await r.json()
        assert rec["decision"] == "keep" and rec["node"].startswith("prefill-")
        m = rec["measured"]
        for k in ("prefill_queue_ms", "prefill_exec_ms", "kv_transfer_ms", "decode_queue_ms", "ttft_ms"):
            assert m[k] is not None and m[k] >= 0, (k, rec)
