"""``kairos plan --from-live URL``: the workload a running Kairos served, from its own request records.

Asks the ingress at URL for ``GET /v1/admin/workload?window_s=W`` (kairos/services/ingress/workload.py:
every ingress's records of the requests that ended in the last W seconds) and writes them as a plain
trace CSV (``arrival_s,prompt_tokens,output_tokens``, arrivals re-based to the first; the format
``--workload trace:PATH`` reads, kairos.core.workload.workloads.load_plain_csv). Requests the ingress
refused before they reached an engine (4xx, no token) are left out: they made no load.
"""

from __future__ import annotations

import csv
import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kairos.contracts.errors import error_message

#: seconds to wait for the ingress's answer (it reads the window's records from the bus)
LIVE_TIMEOUT_S = 60.0


class LiveWorkloadError(ValueError):
    """The live workload could not be read (unreachable ingress, refused, too few requests)."""


def workload_rows(body: dict) -> list[tuple[float, int, int]]:
    """``(arrival_s, prompt_tokens, output_tokens)`` per request of a ``GET /v1/admin/workload`` body
    that made load (status < 400 or tokens delivered), arrivals in s from the first. Raises
    LiveWorkloadError for a body of another shape."""
    try:
        reqs = [r for r in body["requests"] if r["status"] < 400 or r["output_tokens"] > 0]
        t0 = min((r["arrival_unix_ms"] for r in reqs), default=0.0)
        return [(round((r["arrival_unix_ms"] - t0) / 1000.0, 6), int(r["prompt_tokens"]), int(r["output_tokens"]))
                for r in reqs]
    except (KeyError, TypeError, ValueError) as exc:
        raise LiveWorkloadError(f"the ingress's workload answer has another shape ({exc!r}): is it a Kairos ingress?") from None


def fetch_live_workload(url: str, window_s: float, out_csv: Path, api_key: str | None = None,
                        timeout_s: float = LIVE_TIMEOUT_S) -> tuple[str, int]:
    """Read the last ``window_s`` seconds of requests from the ingress at ``url`` into ``out_csv``;
    returns (``trace:<out_csv>``, requests written). Raises LiveWorkloadError naming what failed."""
    base = url.rstrip("/").removesuffix("/v1")
    q = urllib.parse.urlencode({"window_s": f"{window_s:g}"})
    try:
        req = urllib.request.Request(f"{base}/v1/admin/workload?{q}",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        message = error_message(exc.read(), str(exc.reason))
        hint = " (give --api-key KEY, or set OPENAI_API_KEY)" if exc.code == 401 else ""
        raise LiveWorkloadError(f"the ingress at {base} refused: HTTP {exc.code}: {message}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise LiveWorkloadError(f"could not read the workload from the ingress at {base}: {exc}") from None
    rows = workload_rows(body)
    if len(rows) < 2 or len({r[0] for r in rows}) < 2:
        raise LiveWorkloadError(f"the ingress at {base} has {len(rows)} request(s) with distinct arrivals in the "
                                f"last {window_s:g} s: too few to plan from (a longer --window?)")
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    with out_csv.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrival_s", "prompt_tokens", "output_tokens"])
        w.writerows(rows)
    return f"trace:{out_csv}", len(rows)
