"""Read a span file and render one request's trace as an indented tree (``kairos trace``; no I/O).

Where data comes from: the JSON-lines file written by :class:`kairos.runtime.telemetry.JsonLinesSpanExporter`
(``kairos up --trace-file PATH`` / ``KAIROS_TRACE_FILE``): one span per line in the OTel SDK's
``ReadableSpan.to_json`` shape plus ``start_time_unix_nano``/``end_time_unix_nano``. Lines from
every service process are interleaved; a span may be written up to ~0.1 s after it ended. Where it
goes: stdout of ``kairos trace`` (docs/observability.md shows an example).

A request is found by its OpenAI response id (``cmpl-…``/``chatcmpl-…``, the ``kairos.request_id``
attribute every Kairos span carries) or by its 32-hex-digit trace id. All spans of the matching
trace(s) are shown, children under parents in start order, with start offset, duration and the
key attributes of each span kind (the routing decision and its reason on ``dispatcher.decide``,
one line per chunk on ``node.deflected_prefill``).
"""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


class TraceLookupError(Exception):
    """No span of the requested id (the CLI prints the message and exits 2)."""


@dataclass(frozen=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True)
class SpanRecord:
    """One span read back from the file (ids as lowercase hex without ``0x``)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    kind: str  #: SERVER, CONSUMER, PRODUCER, INTERNAL, …
    service: str  #: resource service.name
    instance: str | None  #: resource service.instance.id (replica / node id)
    start_ns: int
    end_ns: int
    status: str  #: UNSET, OK or ERROR
    status_description: str | None
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[SpanEvent, ...] = ()

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)


def _hex(v: Any) -> str | None:
    if not v:
        return None
    s = str(v).lower()
    return s[2:] if s.startswith("0x") else s


def _iso_ns(v: Any) -> int:
    if v is None:
        return 0
    t = _dt.datetime.fromisoformat(str(v).replace("Z", "+00:00"))
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return ((t - _EPOCH) // _dt.timedelta(microseconds=1)) * 1000


def parse_span(obj: dict) -> SpanRecord:
    """A span from one decoded JSON line.

    Raises:
        ValueError: not a span line (missing ids or name).
    """
    ctx = obj.get("context") or {}
    trace_id, span_id = _hex(ctx.get("trace_id")), _hex(ctx.get("span_id"))
    if not trace_id or not span_id or not obj.get("name"):
        raise ValueError("not a span")
    res = (obj.get("resource") or {}).get("attributes") or {}
    start = obj.get("start_time_unix_nano") or _iso_ns(obj.get("start_time"))
    end = obj.get("end_time_unix_nano") or _iso_ns(obj.get("end_time")) or start
    st = obj.get("status") or {}
    events = tuple(SpanEvent(name=e.get("name", ""), time_ns=_iso_ns(e.get("timestamp")),
                             attributes=dict(e.get("attributes") or {})) for e in obj.get("events") or ())
    return SpanRecord(trace_id=trace_id, span_id=span_id, parent_id=_hex(obj.get("parent_id")), name=obj["name"],
                      kind=str(obj.get("kind", "")).rsplit(".", 1)[-1], service=str(res.get("service.name", "?")),
                      instance=res.get("service.instance.id"), start_ns=int(start), end_ns=int(end),
                      status=str(st.get("status_code", "UNSET")), status_description=st.get("description"),
                      attributes=dict(obj.get("attributes") or {}), events=events)


def _parse_lines(lines: Iterable[str], want: Callable[[str], bool]) -> list[SpanRecord]:
    out = []
    for line in lines:
        if not line.strip() or not want(line):
            continue
        try:
            out.append(parse_span(json.loads(line)))
        except (ValueError, TypeError, AttributeError):
            continue  # a torn or foreign line: skip it
    return out


def is_trace_id(key: str) -> bool:
    k = key.lower().removeprefix("0x")
    return len(k) == 32 and all(c in "0123456789abcdef" for c in k)


def find_spans(read_lines: Callable[[], Iterable[str]], key: str) -> list[SpanRecord]:
    """Every span of the trace(s) of request ``key`` (OpenAI id or trace id); [] if none.

    ``read_lines`` is called up to twice (a cheap substring filter first, then the whole traces),
    so a large file is never decoded in full.
    """
    if is_trace_id(key):
        trace_ids = {key.lower().removeprefix("0x")}
    else:
        hits = _parse_lines(read_lines(), lambda line: key in line)
        trace_ids = {s.trace_id for s in hits
                     if key in (s.attributes.get("kairos.request_id"), s.attributes.get("gen_ai.response.id"))}
    if not trace_ids:
        return []
    return _parse_lines(read_lines(), lambda line: any(t in line for t in trace_ids))


# --- rendering ------------------------------------------------------------------------------------

def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms"


def _num(v: Any, unit: str = " ms") -> str:
    if isinstance(v, (int, float)):
        return f"{v:.1f}{unit}" if isinstance(v, float) else f"{v}{unit}"
    return str(v)


def _list(v: Any, fmt: str = "{}") -> str:
    return "[" + ", ".join(fmt.format(x) for x in (v or [])) + "]"


def _per_node(a: dict, prefix: str) -> dict[str, Any]:
    return {k[len(prefix):]: v for k, v in sorted(a.items()) if k.startswith(prefix)}


def _decision_lines(s: SpanRecord) -> tuple[str, list[str]]:
    a = s.attributes
    if "kairos.decision" not in a:
        head = f"outcome {a.get('kairos.outcome', 'unknown')} · policy {a.get('kairos.policy')}"
    else:
        head = (f"{a['kairos.decision'].upper()} → {a.get('kairos.node')} · reason {a.get('kairos.reason')} · "
                f"policy {a.get('kairos.policy')}")
        if a.get("kairos.decision") == "keep" and a.get("kairos.decode_node"):
            head += f" · decode on {a['kairos.decode_node']}"
    lines = []
    est = []
    if "kairos.ttft_prefill_est_ms" in a:
        pf = f"prefill path {_num(a['kairos.ttft_prefill_est_ms'])}"
        if "kairos.kv_transfer_est_ms" in a:
            pf += f" (KV transfer {_num(a['kairos.kv_transfer_est_ms'])})"
        est.append(pf)
    ests = _per_node(a, "kairos.ttft_decode_est_ms.")
    infeasible = _per_node(a, "kairos.decode_infeasible.")
    for node in sorted(set(ests) | set(infeasible)):
        if node in ests:
            est.append(f"{node} {_num(ests[node])}")
        else:
            est.append(f"{node} infeasible ({infeasible[node]})")
    if est:
        lines.append("estimated TTFT: " + " · ".join(est))
    if a.get("kairos.chunk_schedule"):
        lines.append(f"chunk schedule χ {_list(a['kairos.chunk_schedule'])} · predicted step ms "
                     f"{_list(a.get('kairos.predicted_step_ms'), '{:.1f}')}")
    ctx = []
    if "kairos.state_age_ms" in a:
        ctx.append(f"state age {_num(a['kairos.state_age_ms'])}")
    ctx.append(f"model {a.get('kairos.model_version')}")
    ctx.append(f"replica {a.get('kairos.replica_id')}")
    if "kairos.attempts" in a:
        ctx.append(f"attempts {a['kairos.attempts']}")
    if a.get("kairos.delivery", 1) != 1:
        ctx.append(f"delivery {a['kairos.delivery']}")
    lines.append(" · ".join(ctx))
    if a.get("kairos.excluded"):
        lines.append(f"excluded {', '.join(a['kairos.excluded'])}")
    for e in s.events:
        if e.name in ("job_rerouted", "reservation_conflict", "waiting_for_nodes"):
            detail = ", ".join(f"{k.removeprefix('kairos.')}={v}" for k, v in e.attributes.items())
            lines.append(f"{e.name}: {detail}")
    return head, lines


def _chunk_lines(s: SpanRecord) -> list[str]:
    out = []
    chunks = [e for e in s.events if e.name == "chunk"]
    for i, e in enumerate(chunks, 1):
        a = e.attributes
        pred, act = a.get("predicted_ms"), a.get("actual_ms")
        err = ""
        if isinstance(pred, (int, float)) and isinstance(act, (int, float)) and pred > 0:
            err = f"  ({(act - pred) / pred * 100:+.1f}%)"
        out.append(f"chunk {i:>2}  χ={a.get('chi')}  predicted {_num(pred)}  actual {_num(act)}{err}"
                   f"  B={a.get('batch_size')}")
    return out


def summarize(s: SpanRecord) -> tuple[str, list[str]]:
    """(one-line summary, detail lines) of a span's key attributes."""
    a = s.attributes
    n = s.name
    if n == "ingress.request":
        parts = [f"{a.get('http.request.method', 'POST')} {a.get('http.route', '')} → "
                 f"{a.get('http.response.status_code', '?')}",
                 f"id {a.get('kairos.request_id')}", f"model {a.get('gen_ai.request.model')}",
                 f"{a.get('gen_ai.usage.input_tokens', '?')} in / {a.get('gen_ai.usage.output_tokens', '?')} out tokens"]
        if "kairos.ttft_ms" in a:
            parts.append(f"TTFT {_num(a['kairos.ttft_ms'])}")
        return " · ".join(parts), []
    if n == "dispatcher.decide":
        return _decision_lines(s)
    if n == "node.prefill":
        return f"{a.get('kairos.node')} · prompt {a.get('kairos.prompt_tokens')} tokens", []
    if n == "node.kv_handoff":
        head = f"{a.get('kairos.node', '?')} → {a.get('kairos.decode_node', '?')} · {a.get('kairos.kv_tokens')} KV tokens"
        if "kairos.kv_transfer_ms" in a:
            head += f" · transfer {_num(a['kairos.kv_transfer_ms'])}"
        if "kairos.kv_transfer_est_ms" in a:
            head += f" (estimated {_num(a['kairos.kv_transfer_est_ms'])})"
        return head, [f"re-routed from {', '.join(a['kairos.rerouted_from'])}"] if a.get("kairos.rerouted_from") else []
    if n == "node.kv_transfer":
        return (f"{a.get('kairos.src_node')} → {a.get('kairos.node')} · {a.get('kairos.kv_tokens')} KV tokens"
                + (f" · transfer {_num(a['kairos.kv_transfer_ms'])} (incl. link wait)"
                   if "kairos.kv_transfer_ms" in a else "")), []
    if n == "node.deflected_prefill":
        sched = a.get("kairos.chunk_schedule") or []
        run = a.get("kairos.chunks_run", len([e for e in s.events if e.name == "chunk"]))
        return (f"{a.get('kairos.node')} · prompt {a.get('kairos.prompt_tokens')} tokens · {run} chunks run "
                f"({len(sched)} scheduled)"), _chunk_lines(s)
    if n == "node.decode":
        parts = [str(a.get("kairos.node")), f"{a.get('gen_ai.usage.output_tokens', a.get('kairos.completion_tokens', '?'))}"
                 " tokens"]
        if "kairos.tbt_mean_ms" in a:
            parts.append(f"TBT mean {_num(a['kairos.tbt_mean_ms'])}")
        if "kairos.tbt_max_ms" in a:
            parts.append(f"max {_num(a['kairos.tbt_max_ms'])}")
        return " · ".join(parts), []
    shown = [f"{k.removeprefix('kairos.')}={v}" for k, v in sorted(a.items())
             if k.startswith("kairos.") and k != "kairos.request_id"]
    return " · ".join(shown[:8]), []


def render_trace(spans: list[SpanRecord]) -> str:
    """One trace as an indented tree (``spans`` all share one trace id)."""
    if not spans:
        return ""
    by_id = {s.span_id: s for s in spans}
    children: dict[str | None, list[SpanRecord]] = {}
    orphans = []
    for s in spans:
        parent = s.parent_id if s.parent_id in by_id else None
        if s.parent_id and parent is None:
            orphans.append(s.span_id)
        children.setdefault(parent, []).append(s)
    for v in children.values():
        v.sort(key=lambda s: (s.start_ns, s.name))
    t0 = min(s.start_ns for s in spans)
    t1 = max(s.end_ns for s in spans)
    rid = next((s.attributes["kairos.request_id"] for s in spans if "kairos.request_id" in s.attributes), "?")
    services = {s.service for s in spans}
    n_svc = f"{len(services)} service{'s' if len(services) != 1 else ''}"
    out = [f"request {rid}  trace {spans[0].trace_id}  ({len(spans)} spans, {n_svc}, {_ms(t1 - t0)})", "",
           f"{'start':>10} {'duration':>10}  span"]
    blank = " " * 23

    def walk(s: SpanRecord, prefix: str, last: bool, root: bool) -> None:
        connector = "" if root else ("└─ " if last else "├─ ")
        summary, details = summarize(s)
        where = s.instance or s.service
        status = f"  ERROR: {s.status_description or ''}" if s.status == "ERROR" else ""
        note = "  (parent span not in file)" if s.span_id in orphans else ""
        out.append(f"{'+' + _ms(s.start_ns - t0):>10} {_ms(s.duration_ns):>10}  {prefix}{connector}{s.name} "
                   f"[{where}]  {summary}{status}{note}".rstrip())
        kids = children.get(s.span_id, [])
        child_prefix = prefix + ("" if root else ("   " if last else "│  "))
        guide = child_prefix + ("│  " if kids else "   ")
        for d in details:
            out.append(f"{blank}{guide}{d}".rstrip())
        for i, k in enumerate(kids):
            walk(k, child_prefix, i == len(kids) - 1, False)

    for r in children.get(None, []):
        walk(r, "", True, True)
    return "\n".join(out)


def trace_report(read_lines: Callable[[], Iterable[str]], key: str) -> str:
    """The tree(s) of request ``key`` (several traces only if the id was reused).

    Raises:
        TraceLookupError: no span of ``key`` in the file.
    """
    spans = find_spans(read_lines, key)
    if not spans:
        raise TraceLookupError(f"no spans of {key!r} (spans are written about 0.1 s after they finish; "
                               "was the stack started with this --trace-file?)")
    by_trace: dict[str, list[SpanRecord]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    ordered = sorted(by_trace.values(), key=lambda ss: min(s.start_ns for s in ss))
    return "\n\n".join(render_trace(ss) for ss in ordered)
