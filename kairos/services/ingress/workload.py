"""The body of ``GET /v1/admin/workload``: the ingress records of a window as the workload they made.

Input: key → bytes of the requests bucket's ``<rid>.ingress`` records written in the window
(:meth:`~kairos.services.ingress.ports.IngressBus.recent_records`), each a
:class:`kairos.contracts.records.IngressTiming`. Output: a JSON-ready dict, one entry per request that
ended (``finished_unix_ms`` set), oldest arrival first. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Mapping

from kairos.contracts.records import IngressTiming
from kairos.contracts.wire import WireError, decode


def workload_body(records: Mapping[str, bytes], now_unix_ms: float, window_s: float, truncated: bool) -> dict[str, Any]:
    """``{"window_s", "now_unix_ms", "truncated", "skipped", "requests": [{"request_id", "arrival_unix_ms",
    "prompt_tokens", "output_tokens", "status"}]}``: ``skipped`` counts records that would not decode
    (another schema) or whose request had not ended when written (a migrated stream's interim record:
    a running request has none yet); ``truncated``: the read stopped at its limit of record writes
    with more to come (:meth:`~kairos.services.ingress.ports.IngressBus.recent_records`), so the
    window's newest are missing. Arrivals are the ingress's receive times (ms since the epoch)."""
    out, skipped = [], 0
    for key, data in records.items():
        try:
            rec = decode(data, IngressTiming)
        except WireError:
            skipped += 1
            continue
        if rec.finished_unix_ms is None:
            skipped += 1
            continue
        out.append({"request_id": key.rsplit(".", 1)[0], "arrival_unix_ms": rec.received_unix_ms,
                    "prompt_tokens": rec.prompt_tokens, "output_tokens": rec.completion_tokens, "status": rec.status})
    out.sort(key=lambda r: (r["arrival_unix_ms"], r["request_id"]))
    return {"window_s": window_s, "now_unix_ms": now_unix_ms, "truncated": truncated,
            "skipped": skipped, "requests": out}
