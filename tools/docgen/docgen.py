"""Figures in README.md and docs/*.md come from committed result files, never from typing.

A measured figure lives in a *result file* ``bench/results/<name>.jsonl`` (JSON Lines): first a
``{"meta": {...}}`` line — the command, UTC date, machine (CPU count and model, platform), the
1-minute load average before and after, wall seconds, git commit — then one line per result row,
exactly as the command printed it (the benchmarks' JSON lines) or as it wrote it with ``--json``
(``kairos sim``/``bench``/``demo``). A file without the meta line (e.g. ``python
bench/control_plane.py > bench/results/control-plane.jsonl``) is read too.

Markdown files hold *generated blocks*::

    <!-- kairos:generated NAME -->
    ...rendered text...
    <!-- /kairos:generated -->

and ``tools.docgen.blocks.RENDERERS`` maps each NAME to a function that renders the block's text from
the result files or other committed data (``PARAM_RENDERERS``: names ``PREFIX.ARG``, e.g.
``profile-fit.emulated-cpu``). Usage::

    python -m tools.docgen record NAME [--rows-from PATH] -- COMMAND ARGS...  # run, write bench/results/NAME.jsonl
    python -m tools.docgen            # rewrite every generated block from the result files (make docs)
    python -m tools.docgen --check    # exit 1 naming every block that differs (tests/unit/test_docgen.py)

The figure scanner :func:`figures_outside` (digits left once placeholders and allowed names are
removed) is shared with the reproduction report's prose test.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
#: the markdown files that may hold generated blocks (relative to the repo root)
DOC_FILES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))

BLOCK = re.compile(r"(<!-- kairos:generated (?P<name>[\w.+-]+) -->\n)(?P<body>.*?)(<!-- /kairos:generated -->)", re.S)


class DocgenError(Exception):
    """A result file is missing or malformed, or a block names no renderer."""


# ---------------------------------------------------------------- result files

@dataclass(frozen=True)
class Result:
    """One result file: ``meta`` (empty if the file has none) and its ``rows`` (dicts, file order)."""

    name: str
    meta: dict
    rows: list[dict]

    def where(self, **match) -> list[dict]:
        """Rows whose fields equal every ``match`` item."""
        return [r for r in self.rows if all(r.get(k) == v for k, v in match.items())]

    def one(self, **match) -> dict:
        """The single row matching ``match``; :class:`DocgenError` if none or several."""
        rows = self.where(**match)
        if len(rows) != 1:
            raise DocgenError(f"{self.name}: {len(rows)} rows match {match}, expected 1")
        return rows[0]


def load_result(name: str, results_dir: Path = RESULTS) -> Result:
    """Read ``results_dir/<name>.jsonl``. Raises :class:`DocgenError` if it is missing or a line
    is not a JSON object."""
    path = results_dir / f"{name}.jsonl"
    if not path.is_file():
        raise DocgenError(f"no result file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path} "
                          f"(record it: python -m tools.docgen record {name} -- COMMAND)")
    meta: dict = {}
    rows: list[dict] = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DocgenError(f"{path.name}:{i}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise DocgenError(f"{path.name}:{i}: expected a JSON object")
        if set(obj) == {"meta"}:
            meta = obj["meta"]
        else:
            rows.append(obj)
    return Result(name, meta, rows)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def record(name: str, command: list[str], rows_from: str | None = None, results_dir: Path = RESULTS) -> Path:
    """Run ``command`` (stdout passed through), then write ``results_dir/<name>.jsonl``: the meta line
    and, as rows, the JSON-object lines the command printed on stdout or — with ``rows_from`` — the
    JSON file it wrote (a list: one row per item; an object: one row).

    Raises :class:`DocgenError` if the command fails or yields no rows (nothing is written then).
    """
    if not command:
        raise DocgenError("record needs a command after --")
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    started = _dt.datetime.now(_dt.timezone.utc)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    rows: list[dict] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if not rows_from and line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                rows.append(obj)
    rc = proc.wait()
    wall = time.monotonic() - t0
    if rc != 0:
        raise DocgenError(f"{' '.join(command)} exited with {rc}; {name}.jsonl not written")
    if rows_from:
        src = ROOT / rows_from
        if not src.is_file() or src.stat().st_mtime < started.timestamp() - 1.0:
            raise DocgenError(f"{rows_from} was not written by this run; {name}.jsonl not written")
        data = json.loads(src.read_text())
        rows = list(data) if isinstance(data, list) else [data]
    if not rows:
        raise DocgenError(f"{' '.join(command)} printed no JSON rows; {name}.jsonl not written")
    return write_result(results_dir / f"{name}.jsonl", result_meta(command, started, load0, wall), rows)


def result_meta(command: list[str], started: _dt.datetime, load0: float, wall_s: float) -> dict:
    """The meta line of a result file: ``command`` (argv, joined), ``started`` (UTC) as the date, this
    machine, the 1-minute load average ``load0`` at the start and now, ``wall_s`` seconds, the commit."""
    return {
        "command": " ".join(command),
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "cpu_model": _cpu_model(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "loadavg_1m": {"start": round(load0, 2), "end": round(os.getloadavg()[0], 2)},
        "wall_s": round(wall_s, 1),
        "commit": _git_commit(),
    }


def write_result(path: Path, meta: dict, rows: list[dict]) -> Path:
    """Write a result file: the ``{"meta": meta}`` line, then one JSON line per row. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(x) + "\n" for x in [{"meta": meta}, *rows]))
    return path


# ---------------------------------------------------------------- figure scanner

#: digits that are names, not figures: percentiles, section/equation/table/figure numbers, issue
#: numbers, a citation year, and code spans (policy specs such as `sq:1`, file names, commands)
ALLOWED = (r"<!-- [\w.+ -]+ -->", r"`[^`\n]*`", r"\bP\d{2}\b", r"§\d+(\.\d+)*", r"\bTable \d+", r"\bEq\. \d+(–\d+)?",
           r"\bAlgorithm \d", r"\bFigure \d+", r"[Ii]ssue-\d+", r"et al\., \d{4}")


def figures_outside(text: str, allowed: tuple[str, ...] = ALLOWED) -> list[str]:
    """Lines of ``text`` that still hold a digit once ``{placeholders}``, generated blocks and the
    ``allowed`` patterns (regexes of digits that are names, not figures) are removed."""
    text = BLOCK.sub("", text)
    text = re.sub(r"\{[^{}\n]*\}", "", text)
    for pat in allowed:
        text = re.sub(pat, "", text)
    return [line.strip() for line in text.splitlines() if re.search(r"\d", line)]


def section(text: str, heading: str) -> str:
    """The markdown section under the line ``heading`` (e.g. ``"### Measured figures"``) up to the
    next heading of the same or a higher level. Raises :class:`DocgenError` if it is missing."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        raise DocgenError(f"no section {heading!r}") from None
    out = []
    in_code = False
    for line in lines[start + 1:]:
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"(#+) ", line)
        if m and not in_code and len(m.group(1)) <= level:
            break
        out.append(line)
    return "\n".join(out)


#: sections whose every figure must sit in a generated block: (file, heading, extra allowed patterns)
FIGURE_FREE_SECTIONS = (
    ("README.md", "## Results", (r"\b\d+P\d+D\b",)),
)


def typed_figures(root: Path = ROOT) -> list[str]:
    """``file: section: line`` for every line of :data:`FIGURE_FREE_SECTIONS` that holds a digit
    outside generated blocks, code spans and the allowed names (a figure typed by hand)."""
    out = []
    for rel, heading, extra in FIGURE_FREE_SECTIONS:
        text = section((root / rel).read_text(), heading)
        out += [f"{rel}: {heading}: {line}" for line in figures_outside(text, ALLOWED + extra)]
    return out


# ---------------------------------------------------------------- generated blocks

def render_block(name: str, results_dir: Path = RESULTS) -> str:
    """The text of block ``name`` (ends with a newline). Raises :class:`DocgenError`."""
    from tools.docgen import blocks as docblocks

    def load(n: str) -> Result:
        return load_result(n, results_dir)

    prefix, _, arg = name.partition(".")
    if name in docblocks.RENDERERS:
        text = docblocks.RENDERERS[name](load)
    elif arg and prefix in docblocks.PARAM_RENDERERS:
        text = docblocks.PARAM_RENDERERS[prefix](load, arg)
    else:
        raise DocgenError(f"no renderer for generated block {name!r} (tools/docgen/blocks.py RENDERERS)")
    return wrap(text.rstrip("\n")) + "\n"


UNIT_SPACE = re.compile(r"(?<=\d) (?=(?:ms|s|µs|%|×|req/s|RPS|GB|requests)\b|[%×])")


def wrap(text: str, width: int = 100) -> str:
    """Prose lines of ``text`` filled to ``width`` columns (as the hand-written docs are); table rows,
    list items' continuation, code fences and their contents are left as they are."""
    import textwrap

    out, in_code = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            in_code = not in_code
            out.append(line)
        elif in_code or line.startswith("|") or len(line) <= width:
            out.append(line)
        else:
            glued = UNIT_SPACE.sub("\0", line)  # never break between a figure and its unit
            out.append(textwrap.fill(glued, width, break_long_words=False, break_on_hyphens=False).replace("\0", " "))
    return "\n".join(out)


def regenerate(text: str, results_dir: Path = RESULTS) -> str:
    """``text`` with every generated block's body replaced by its rendering."""
    return BLOCK.sub(lambda m: m.group(1) + render_block(m.group("name"), results_dir) + m.group(4), text)


def stale_blocks(root: Path = ROOT, results_dir: Path = RESULTS) -> list[str]:
    """``file: block`` for every generated block in :data:`DOC_FILES` whose text differs from its
    rendering (a hand edit or results newer than the docs)."""
    out = []
    for rel in DOC_FILES:
        path = root / rel
        if not path.is_file():
            continue
        for m in BLOCK.finditer(path.read_text()):
            if m.group("body") != render_block(m.group("name"), results_dir):
                out.append(f"{rel}: {m.group('name')}")
    return out


def _record_main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: python -m tools.docgen record NAME [--rows-from PATH] -- COMMAND ARGS...", file=sys.stderr)
        return 2
    head, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    rows_from = None
    if "--rows-from" in head:
        i = head.index("--rows-from")
        rows_from = head[i + 1] if i + 1 < len(head) else None
        del head[i:i + 2]
    if len(head) != 1 or not re.fullmatch(r"[\w.+-]+", head[0]):
        print("record: expected one NAME ([A-Za-z0-9_.+-]) before --", file=sys.stderr)
        return 2
    try:
        path = record(head[0], command, rows_from)
    except (DocgenError, OSError, json.JSONDecodeError) as exc:
        print(f"record: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["record"]:
        return _record_main(argv[1:])
    if argv not in ([], ["--check"]):
        print("usage: python -m tools.docgen [--check] | record NAME [--rows-from PATH] -- COMMAND", file=sys.stderr)
        return 2
    try:
        if argv == ["--check"]:
            stale, typed = stale_blocks(), typed_figures()
            for s in stale:
                print(f"stale generated block: {s} (run: python -m tools.docgen)", file=sys.stderr)
            for s in typed:
                print(f"figure typed outside a generated block: {s}", file=sys.stderr)
            return 1 if stale or typed else 0
        for rel in DOC_FILES:
            path = ROOT / rel
            old = path.read_text()
            new = regenerate(old)
            if new != old:
                path.write_text(new)
                print(f"rewrote {rel}", file=sys.stderr)
    except DocgenError as exc:
        print(f"docgen: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
