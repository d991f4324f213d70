"""Validation cost per request (issue 36): the hand-written validation of commit 27857c5 against the
models' (``openai_api.parse_request`` now), in one run on the same bodies.

``before`` is ``kairos/services/ingress/openai_api/`` as it was at ``--before`` (default 27857c5, the
last commit with the hand-written field readers), read with ``git show`` into a temporary package
(its ``kairos.services.ingress.openai_api`` imports pointed at it; everything else it imports is
today's ``kairos``); ``after`` is this checkout's. Each case is a request body as the ingress has it
(parsed JSON), validated by ``parse_request`` as the ingress calls it (``prepare_request`` adds the
token count, the same code in both):

* ``completion``: ``vllm bench serve``'s completions body (kairos' tests: ``test_vllm_bench_serve_
  payloads_are_accepted``) with a 1,000-character prompt and the usual sampling parameters;
* ``chat``: a three-message chat with sampling parameters, ``stop``, ``logit_bias``, streaming usage;
* ``completion-100k-ids``: a prompt of 100,000 token ids; ``chat-100k-text``: a chat whose user
  message is 400,000 characters (about 100,000 tokens by the estimate).

Both paths must return the same request (compared field by field: the run stops otherwise). The
paths alternate round by round (``--rounds``, each ``--calls`` calls per path and case) and the
result per path is the median over rounds of the mean µs of the thread's CPU time per call
(``time.thread_time_ns``: the machine is shared). Prints one JSON row per case
(``{"case", "before_us", "after_us", "before_over_after", ...}``) after a table.

    python bench/validation_cost.py [--rounds 15] [--calls 200] [--before 27857c5]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from kairos.services.ingress import openai_api as after

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "kairos/services/ingress/openai_api"


def load_before(commit: str, into: Path) -> object:
    """The ``openai_api`` package of ``commit`` imported as ``openai_api_before`` from ``into``."""
    names = subprocess.run(["git", "ls-tree", "--name-only", commit, f"{PACKAGE}/"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    pkg = into / "openai_api_before"
    pkg.mkdir()
    for name in names:
        if name.endswith(".py"):
            src = subprocess.run(["git", "show", f"{commit}:{name}"], cwd=ROOT, check=True, capture_output=True,
                                 text=True).stdout
            (pkg / Path(name).name).write_text(src.replace("kairos.services.ingress.openai_api", "openai_api_before"))
    sys.path.insert(0, str(into))
    return importlib.import_module("openai_api_before")


def cases() -> dict[str, tuple[str, dict]]:
    """The request bodies, by case name (module docstring)."""
    words = " ".join(f"w{i % 97}" for i in range(250))[:1000]
    sampling = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 128, "seed": 7, "presence_penalty": 0.1}
    return {
        "completion": ("completions", {"model": "m", "prompt": words, "repetition_penalty": 1.0, "max_tokens": 128,
                                       "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                                       "ignore_eos": True, "temperature": 0.0}),
        "chat": ("chat", {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                     {"role": "user", "content": words},
                                                     {"role": "assistant", "content": "ok"}],
                          **sampling, "stop": ["\n\n", "END"], "logit_bias": {"7": -100, "42": 5},
                          "stream": True, "stream_options": {"include_usage": True}, "user": "u1"}),
        "completion-100k-ids": ("completions", {"model": "m", "prompt": [i % 31_000 for i in range(100_000)],
                                                **sampling}),
        "chat-100k-text": ("chat", {"model": "m", "messages": [{"role": "user", "content": "abcd" * 100_000}],
                                    **sampling}),
    }


def same_result(a: object, b: object) -> bool:
    """The two paths' ``ParsedRequest`` (dataclasses of two modules) hold the same values."""
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)  # type: ignore[call-overload]
    da["sampling"], db["sampling"] = msgspec.to_builtins(da["sampling"]), msgspec.to_builtins(db["sampling"])
    return da == db


def timed(parse, endpoint: str, body: dict, calls: int) -> float:
    """Mean µs of the thread's CPU time per ``parse`` call."""
    t0 = time.thread_time_ns()
    for _ in range(calls):
        parse(endpoint, body, ["m"])
    return (time.thread_time_ns() - t0) / calls / 1000.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200, help="calls per round (the 100k cases: a tenth)")
    ap.add_argument("--before", default="27857c5")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = load_before(args.before, Path(tmp))
        rows = []
        for case, (endpoint, body) in cases().items():
            old, new = before.parse_request(endpoint, body, ["m"]), after.parse_request(endpoint, body, ["m"])
            if not same_result(old, new):
                raise SystemExit(f"{case}: the two paths disagree:\n{old}\n{new}")
            calls = max(1, args.calls // 10) if "100k" in case else args.calls
            times: dict[str, list[float]] = {"before": [], "after": []}
            for _ in range(args.rounds):
                times["before"].append(timed(before.parse_request, endpoint, body, calls))
                times["after"].append(timed(after.parse_request, endpoint, body, calls))
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            rows.append({"case": case, "endpoint": endpoint, "body_bytes": len(json.dumps(body)),
                         "before_us": round(b, 2), "after_us": round(a, 2), "before_over_after": round(b / a, 3),
                         "rounds": args.rounds, "calls": calls, "before_commit": args.before})
    print(f"{'case':<22}{'before µs':>12}{'after µs':>12}{'before/after':>14}")
    for r in rows:
        print(f"{r['case']:<22}{r['before_us']:>12.1f}{r['after_us']:>12.1f}{r['before_over_after']:>14.2f}")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
