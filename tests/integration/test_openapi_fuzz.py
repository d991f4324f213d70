"""The fuzzing tier (issue 36): schemathesis against the running ingress, from its own ``/openapi.json``.

The whole stack runs on emulated engines with a real nats-server (:func:`~tests.integration.conftest.stack`);
schemathesis (its CLI, in a subprocess, so this event loop keeps serving) reads the document the
ingress serves and sends every operation :data:`EXAMPLES` generated requests and more (its examples,
coverage and fuzzing phases; positive and negative data), one at a time. It passes when no answer
is a 5xx (``not_a_server_error``), every answer matches the document (``response_schema_conformance``),
and the stack still serves a normal request afterwards. Left out of the run: ``POST
/v1/admin/nodes/{node}/drain`` (a generated node name that exists would drain it), called once for a
404 and once for a 202 at the end instead, each answer checked against the document.

``KAIROS_FUZZ_EXAMPLES`` overrides :data:`EXAMPLES` and ``KAIROS_FUZZ_SEED`` :data:`SEED` (a longer run
by hand: 1,000 examples with seed 36 and 600 with seed 7 passed); a run's seed is fixed, so a finding
reproduces (schemathesis prints the ``curl`` of each failing case).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path

import jsonschema
import pytest

from kairos.core.model.latency import LatencyModel
from tests.integration.conftest import fast_model, poll_health, stack

pytestmark = pytest.mark.integration

#: generated requests per operation (the issue's target: at least 200 in CI)
EXAMPLES = int(os.environ.get("KAIROS_FUZZ_EXAMPLES", "200"))
SEED = int(os.environ.get("KAIROS_FUZZ_SEED", "36"))
#: readiness answers 503 while a part is missing (documented; a busy machine can make the view stale for a
#: moment): not a server error of the API, whose every other answer must be no 5xx
HEALTH_503 = """
[[operations]]
include-path = "/health"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]
"""
#: the engines' context (tokens): bounds the work of one generated request (:func:`small_context_model`)
CONTEXT = 1024
CLI = Path(sys.executable).parent / "schemathesis"


async def test_the_api_against_its_openapi_document(nats_url, tmp_path):
    model, profile = small_context_model(tmp_path)
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, policy="pd", model=model, request_timeout_s=120,
                     idle_timeout_s=60, ingress_overrides={"profile": str(profile)}) as st:
        assert (await poll_health(st.base, st.http, 200, 10))["status"] == "ok"
        report, config = tmp_path / "fuzz.ndjson", tmp_path / "schemathesis.toml"
        config.write_text(HEALTH_503, encoding="utf-8")
        proc = await asyncio.create_subprocess_exec(
            str(CLI), "--config-file", str(config), "run", f"{st.base}/openapi.json", "--url", st.base,
            "--workers", "1",
            "--checks", "not_a_server_error,response_schema_conformance", "--mode", "all",
            "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--generation-database", "none",
            "--exclude-operation-id", "drainNode", "--request-timeout", "150", "--no-color",
            "--suppress-health-check", "all", "--report", "ndjson", "--report-ndjson-path", str(report),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,  # its .schemathesis/ cache
            env={**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"})
        out = (await proc.communicate())[0].decode(errors="replace")
        assert proc.returncode == 0, out[-12000:]
        # every operation of the document was tested, none skipped or errored
        m = re.search(r"Selected: (\d+)/\d+\s+Tested: (\d+)", out)
        assert m and m.group(1) == m.group(2), out[-4000:]  # every selected operation was tested
        sent = requests_per_operation(report)
        print(f"schemathesis requests per operation: {json.dumps(sent, sort_keys=True)}")  # shown with -s
        for op in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
                   "GET /v1/requests/{id}", "GET /v1/admin/workload"):
            # operations without inputs (/v1/models, /health, /version, /metrics on an ingress without
            # keys: no Authorization header in the document either) get a handful
            assert sent.get(op, 0) >= EXAMPLES, sent
        status, body = await st.complete("still serving", max_tokens=3)
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
        # the operation left out, once each way, last (a drained node leaves): its answers fit the document
        async with st.http.get(f"{st.base}/openapi.json") as r:
            doc = await r.json()
        for node, want, schema in (("nope", 404, "ErrorResponse"), ("decode-0", 202, "DrainResponse")):
            async with st.http.post(f"{st.base}/v1/admin/nodes/{node}/drain") as r:
                assert r.status == want
                jsonschema.validate(await r.json(), {"$ref": f"#/components/schemas/{schema}", **doc})


def small_context_model(tmp_path: Path) -> tuple[LatencyModel, Path]:
    """Engines 100x faster than the default profile with a :data:`CONTEXT`-token context, and its
    profile file (the ingress reads its ``max_model_len`` from it): every request the fuzzer can make
    valid (``n`` up to 64 choices of up to the whole context) ends within the stack's timeouts on one
    prefill and one decode node — on the default 32k context such a request takes minutes and ends in a
    504 ``timeout`` (legitimately: a sub-request queued that long gets no token within ``idle_timeout_s``)."""
    d = fast_model(0.01, 0.01).to_dict()
    d["engine"]["max_model_len"] = CONTEXT
    path = tmp_path / "fuzz-profile.json"
    path.write_text(json.dumps(d), encoding="utf-8")
    return LatencyModel.from_dict(d), path


def requests_per_operation(report: Path) -> dict[str, int]:
    """Requests schemathesis sent per operation (``"POST /tokenize"``), from its NDJSON report."""
    sent: dict[str, int] = {}
    with report.open(encoding="utf-8") as f:
        for line in f:
            done = json.loads(line).get("ScenarioFinished")
            if done is not None:
                label = done["recorder"]["label"]
                sent[label] = sent.get(label, 0) + len(done["recorder"].get("interactions", {}))
    return sent
