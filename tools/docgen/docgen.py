"""Figures in README.md and docs/*.md come from committed result files, never from typing.

Markdown files hold *generated blocks*::

    <!-- kairos:generated NAME -->
    ...rendered text...
    <!-- /kairos:generated -->

``tools.docgen.blocks.BLOCKS`` registers each NAME: its renderer (a function of the result files
``bench/results/<name>.jsonl``, :mod:`tools.docgen.results`, or of other committed data) and the
markdown file(s) that hold it. Usage::

    python -m tools.docgen record NAME [--rows-from PATH] -- COMMAND ARGS...  # run, write bench/results/NAME.jsonl
    python -m tools.docgen            # rewrite every generated block from the result files (make docs)
    python -m tools.docgen --check    # exit 1 naming every block that differs or is misplaced, and every typed figure

The figure scanner :func:`figures_outside` (digits left once placeholders and allowed names are
removed) is shared with the reproduction report's prose test.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

from tools.docgen import blocks
from tools.docgen.results import (RESULTS, ROOT, DocgenError, Result, load_result, record, result_meta,  # noqa: F401
                                  write_result)

#: the markdown files that may hold generated blocks (relative to the repo root)
DOC_FILES = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))

BLOCK = re.compile(r"(<!-- kairos:generated (?P<name>[\w.+-]+) -->\n)(?P<body>.*?)(<!-- /kairos:generated -->)", re.S)


# ---------------------------------------------------------------- figure scanner

#: digits that are names, not figures: percentiles, section/equation/table/figure numbers, issue
#: numbers, a citation year, code spans (policy specs such as `sq:1`, file names, commands) and
#: the targets of links (file names, anchors)
ALLOWED = (r"<!-- [\w.+ -]+ -->", r"`[^`\n]*`", r"\]\([^)\s]*\)", r"\bP\d{2}\b", r"§\d+(\.\d+)*", r"\bTable \d+", r"\bEq\. \d+(–\d+)?",
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
    ("docs/results.md", "## The simulator", (r"\b\d+P\d+D\b",)),
    ("docs/results.md", "## Decision cost", (r"\b\d+P\d+D\b",)),
    ("docs/results.md", "## Control-plane throughput", (r"\b\d+P\d+D\b",)),
    ("docs/results.md", "## Fidelity: the live system vs the simulator", (r"\b\d+P\d+D\b",)),
)


def typed_figures(root: Path = ROOT, sections: tuple = FIGURE_FREE_SECTIONS) -> list[str]:
    """``file: section: line`` for every line of ``sections`` (``(file, heading, extra allowed
    patterns)``) that holds a digit outside generated blocks, code spans, link targets and the
    allowed names (a figure typed by hand). Raises :class:`DocgenError` if a section is missing."""
    out = []
    for rel, heading, extra in sections:
        text = section((root / rel).read_text(), heading)
        out += [f"{rel}: {heading}: {line}" for line in figures_outside(text, ALLOWED + extra)]
    return out


# ---------------------------------------------------------------- generated blocks

def render_block(name: str, results_dir: Path = RESULTS) -> str:
    """The text of block ``name`` (ends with a newline). Raises :class:`DocgenError`."""
    block = blocks.BLOCKS.get(name)
    if block is None:
        raise DocgenError(f"no renderer for generated block {name!r} (register it in tools/docgen/blocks.py BLOCKS)")
    text = block.render(lambda n: load_result(n, results_dir))
    return wrap(text.rstrip("\n")) + "\n"


UNIT_SPACE = re.compile(r"(?<=\d) (?=(?:ms|s|µs|%|×|req/s|RPS|GB|requests)\b|[%×])")


def wrap(text: str, width: int = 100) -> str:
    """Prose lines of ``text`` filled to ``width`` columns (as the hand-written docs are); table rows,
    list items' continuation, code fences and their contents are left as they are."""
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


def misplaced_blocks(root: Path = ROOT, doc_files: tuple[str, ...] = DOC_FILES) -> list[str]:
    """What differs between where :data:`tools.docgen.blocks.BLOCKS` says each block is and where it
    is: a block in a file the registry does not name for it (or not registered at all), a registered
    file missing it, a file of the registry that no docgen run reads."""
    found: dict[str, set[str]] = {}
    for rel in doc_files:
        path = root / rel
        if path.is_file():
            for m in BLOCK.finditer(path.read_text()):
                found.setdefault(m.group("name"), set()).add(rel)
    out = []
    for name, files in sorted(found.items()):
        block = blocks.BLOCKS.get(name)
        for rel in sorted(files - set(block.files if block else ())):
            out.append(f"{rel}: {name}: not registered for this file in tools/docgen/blocks.py BLOCKS")
    for name, block in blocks.BLOCKS.items():
        for rel in block.files:
            if rel not in doc_files:
                out.append(f"{rel}: {name}: registered for a file docgen does not read (DOC_FILES)")
            elif rel not in found.get(name, set()):
                out.append(f"{rel}: {name}: registered here, but the file holds no such block")
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
            stale, misplaced, typed = stale_blocks(), misplaced_blocks(), typed_figures()
            for s in stale:
                print(f"stale generated block: {s} (run: python -m tools.docgen)", file=sys.stderr)
            for s in misplaced:
                print(f"misplaced generated block: {s}", file=sys.stderr)
            for s in typed:
                print(f"figure typed outside a generated block: {s}", file=sys.stderr)
            return 1 if stale or misplaced or typed else 0
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
