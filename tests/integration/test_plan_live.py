"""``kairos plan --from-live`` against a running stack: a real nats-server with the generated permission
table, the services logged in as their roles, an ingress with an API key. The workload the planner
reads back must be exactly what the clients sent (arrivals, prompt and output lengths), and the
ingress must refuse the window to a client without the key and a window that is not a number."""

from __future__ import annotations

import asyncio
import csv
import json

import aiohttp
import pytest
from click.testing import CliRunner

from kairos.cli.main import main
from tests.integration.conftest import secure_server, stack

KEY = "sk-plan-live"
NODES = ["prefill-0", "decode-0"]


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    with secure_server(tmp_path_factory.mktemp("plan-nats"), NODES) as server:
        yield server


async def poll(http: aiohttp.ClientSession, url: str, done, timeout_s: float = 10.0) -> dict:
    """GET ``url`` until ``done(body)`` (records are written in the background); the last body."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        async with http.get(url) as r:
            body = await r.json()
        if r.status == 200 and done(body):
            return body
        assert asyncio.get_running_loop().time() < deadline, f"{url}: never done: {r.status} {body}"
        await asyncio.sleep(0.05)


async def test_plan_from_live_plans_the_workload_the_stack_served(secure, tmp_path):
    url, pw = secure
    async with stack(url, prefill=1, decode=1, dispatchers=1, passwords=pw, policy="pd",
                     ingress_overrides={"api_keys": (KEY,)}) as st:
        auth = {"Authorization": f"Bearer {KEY}"}
        sent = []
        async with aiohttp.ClientSession(headers=auth) as http:
            for i in range(6):  # prompts of growing length, outputs of i + 2 tokens
                body = {"model": "kairos-emulated", "prompt": "word " * (5 + 20 * i), "max_tokens": i + 2}
                async with http.post(f"{st.base}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    sent.append((await r.json())["id"])
                await asyncio.sleep(0.05 * (i % 3))  # uneven gaps, to see the arrivals come back
            records = []
            for rid in sent:  # the ingress part of each record, as GET /v1/requests/{id} shows it
                rec = await poll(http, f"{st.base}/v1/requests/{rid}", lambda b: b["records"]["ingress"] is not None)
                records.append(rec["records"]["ingress"])
            body = await poll(http, f"{st.base}/v1/admin/workload?window_s=120",
                              lambda b: len(b["requests"]) == len(sent))
            assert [r["request_id"] for r in body["requests"]] == sent
            async with aiohttp.ClientSession() as anon:  # no key: refused
                async with anon.get(f"{st.base}/v1/admin/workload") as r:
                    assert r.status == 401
            for bad in ("abc", "1_0", "inf", "0", "60&window_s=abc"):
                async with http.get(f"{st.base}/v1/admin/workload?window_s={bad}") as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "window_s", bad

        args = ["plan", "--from-live", st.base + "/v1", "--api-key", KEY, "--window", "120", "--nodes", "2:3",
                "--seeds", "1", "--jobs", "1", "--cache-dir", str(tmp_path / "c"), "--emit-dir", str(tmp_path),
                "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "plan.json")]
        res = await asyncio.to_thread(CliRunner().invoke, main, args)  # the ingress answers on this loop
        assert res.exit_code == 0, res.output
    rows = list(csv.DictReader((tmp_path / "live-workload.csv").open()))
    assert [int(r["output_tokens"]) for r in rows] == [i + 2 for i in range(6)]
    assert [int(r["prompt_tokens"]) for r in rows] == [rec["prompt_tokens"] for rec in records]
    assert len({int(r["prompt_tokens"]) for r in rows}) == 6
    t0 = records[0]["received_unix_ms"]
    assert [float(r["arrival_s"]) for r in rows] == pytest.approx(
        [(rec["received_unix_ms"] - t0) / 1000.0 for rec in records], abs=1e-6)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["workload"] == f"trace:{tmp_path / 'live-workload.csv'}" and plan["duration_s"] == 120
    assert [p["policy"] for p in plan["policies"]] == ["pd", "kairos+"]
    assert "6 requests of the last 120 s" in res.output
