"""``kairos demo --engine vllm`` several times in a row; their JSON reports as one list.

    python bench/vllm_demo_runs.py [--runs 3] [--out out/vllm-demo-runs.json] [-- DEMO OPTIONS]

Each run is a fresh demo (its own stack, the same seeded workload). A run whose requests did not
all complete is kept (it is a result, the table says so); a run that wrote no report fails this
script. ``python -m tools.docgen record vllm-demo --rows-from out/vllm-demo-runs.json -- python
bench/vllm_demo_runs.py`` makes ``bench/results/vllm-demo.jsonl``, which the docs/results.md block
``vllm-demo`` renders.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="out/vllm-demo-runs.json")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    kairos = str(Path(sys.executable).with_name("kairos"))
    reports = []
    with tempfile.TemporaryDirectory(prefix="kairos-demo-runs-") as tmp:
        for i in range(args.runs):
            path = Path(tmp) / f"run-{i}.json"
            rc = subprocess.call([kairos, "demo", "--engine", "vllm", "--no-progress", "--json", str(path), *extra])
            if not path.is_file():
                print(f"run {i + 1}: no report (exit {rc})", file=sys.stderr)
                return 1
            reports.append({**json.loads(path.read_text()), "run": i + 1, "exit_code": rc})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(reports, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
