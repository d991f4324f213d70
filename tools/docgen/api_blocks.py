"""Blocks of the OpenAI API's docs (docs/api.md).

* ``validation-cost``: ``bench/validation_cost.py`` — request validation per request, the
  hand-written field readers (``before``, the commit the rows name) against the request models
  (``after``), on the same bodies in one run.

Every figure is a field of the committed rows (µs of the thread's CPU time) or arithmetic on them.
"""

from __future__ import annotations

from tools.docgen.fmt import num, one_run, sig
from tools.docgen.results import Load


def validation_cost(load: Load) -> str:
    """One row per request body: its size, µs per request before and after, and their ratio."""
    r = load("validation-cost")
    commits = sorted({row["before_commit"] for row in r.rows})
    lines = [f"Validation (`parse_request`) per request, before (the hand-written field readers of "
             f"{', '.join(f'`{c}`' for c in commits)}) and after (the request models), median over rounds of "
             f"the mean µs of the thread's CPU time (rows of {one_run(r)}):", "",
             "| request body | JSON bytes | before µs | after µs | before/after |", "|---|---|---|---|---|"]
    for row in r.rows:
        lines.append(f"| `{row['case']}` | {num(row['body_bytes'])} | {sig(row['before_us'], 3)} | "
                     f"{sig(row['after_us'], 3)} | {sig(row['before_over_after'])} |")
    return "\n".join(lines)
