"""The one set of formatters of the generated docs: the blocks of README.md and docs/*.md
(:mod:`tools.docgen.blocks`) and the reproduction report (:mod:`tools.docgen.reproduction`).

Figures in, text out; nothing here reads a file. ``None`` (a missing figure) prints as ``–``.
Units: durations are given in ms unless the name says otherwise (``us``: µs), fractions in [0, 1].
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from tools.docgen.results import Result

MISSING = "–"


def num(x: float | None, nd: int = 0) -> str:
    """``x`` with ``nd`` decimals and thousands separators (``1,234.5``); ``–`` for None."""
    return MISSING if x is None else f"{x:,.{nd}f}"


def sig(x: float, digits: int = 2) -> str:
    """``x`` to ``digits`` significant figures, never in exponent form and never fewer than its
    integer digits (13, 4.3, 0.17, 1,134)."""
    if x == 0:
        return "0"
    nd = max(0, digits - 1 - int(f"{abs(x):e}".split("e")[1]))
    return num(round(x, nd), nd)


def us(x: float) -> str:
    """A duration given in µs: ``13 µs``, ``460 µs``, ``4.3 ms``."""
    return f"{sig(x)} µs" if x < 1000 else f"{sig(x / 1000.0)} ms"


def ms(x: float | None) -> str:
    """A latency in ms: one decimal below 100 ms (``9.4 ms``), none above (``127 ms``)."""
    return MISSING if x is None else f"{x:.1f} ms" if x < 100 else f"{num(x)} ms"


def in_seconds(ms_: float | None, nd: int = 2) -> str:
    """A duration given in ms as a figure in seconds with ``nd`` decimals, no unit (``9.41``)."""
    return MISSING if ms_ is None else num(ms_ / 1000.0, nd)


def seconds(ms_: float | None, nd: int = 1) -> str:
    """A duration given in ms, in seconds with ``nd`` decimals and the unit (``9.4 s``)."""
    return MISSING if ms_ is None else f"{in_seconds(ms_, nd)} s"


def pct(frac: float | None, nd: int = 0) -> str:
    """A fraction as a percentage (``0.684`` → ``68 %``)."""
    return MISSING if frac is None else f"{100.0 * frac:.{nd}f} %"


def ratio(a: float | None, b: float | None, nd: int = 2) -> str:
    """``a ÷ b`` with ``nd`` decimals (``0.75``); ``–`` when either is missing or ``b`` is 0."""
    return MISSING if a is None or not b else f"{a / b:.{nd}f}"


def span(values: Iterable[float | None], fmt: Callable[[float], str]) -> str:
    """``a–b`` over ``values`` formatted with ``fmt`` (``a`` alone if they agree once formatted);
    missing values are skipped, ``–`` if none is left."""
    vals = [v for v in values if v is not None]
    if not vals:
        return MISSING
    lo, hi = fmt(min(vals)), fmt(max(vals))
    return lo if lo == hi else f"{lo}–{hi}"


def num_range(values: Iterable[float | None], nd: int = 0, scale: float = 1.0) -> str:
    """:func:`span` of ``values`` times ``scale`` as :func:`num` with ``nd`` decimals (``4.2–5.1``)."""
    return span((None if v is None else v * scale for v in values), lambda x: num(x, nd))


def command(meta: dict) -> str:
    """The recorded command as a user types it: without the ``.venv/bin/`` prefix (relative or absolute) and without the
    ``--json PATH`` / ``--no-progress`` the recorder used to collect the rows quietly."""
    cmd = meta.get("command", "")
    cmd = re.sub(r"^timeout \d+ ", "", cmd)
    cmd = re.sub(r"(^|\s)(?:/\S*/)?\.venv/bin/", r"\1", cmd)
    cmd = re.sub(r"(^|\s)/(?:root|home/[^/\s]+)/\.cache/", r"\1~/.cache/", cmd)
    cmd = re.sub(r"\s--json\s+\S+", "", cmd)
    cmd = re.sub(r"\s--no-progress\b", "", cmd)
    return cmd


def provenance(r: Result) -> str:
    """``2026-11-30, 2 cores, 1-minute load average 4.0–4.4`` from a result's meta
    (the 1-minute load average before and after the run; '' without meta)."""
    m = r.meta
    if not m:
        return ""
    load = m.get("loadavg_1m", {})
    cores = m.get("machine", {}).get("cpus")
    return (f"{m.get('date', '?')[:10]}, {cores} cores, 1-minute load average "
            f"{span([load.get('start', 0.0), load.get('end', 0.0)], lambda x: f'{x:.1f}')}")


def one_run(r: Result) -> str:
    """```command`; one run: <provenance>`` — what a figure from a single recorded run says about it."""
    return f"`{command(r.meta)}`; one run: {provenance(r)}"


def code_counts(codes: dict[str, int]) -> str:
    """``\\`node_lost\\` 3, \\`bus_unavailable\\` 1``: error codes by count, most frequent first."""
    return ", ".join(f"`{k}` {num(v)}" for k, v in sorted(codes.items(), key=lambda kv: -kv[1]))
