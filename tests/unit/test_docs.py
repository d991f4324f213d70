"""The README and docs/ hold together: every relative link (and its ``#anchor``) resolves, the
README stays a short entry page (issue 18: at most 250 lines, the two set-up commands the Makefile
defines), and every document of docs/ is reachable from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250

LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)|!\[[^\]\n]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of ``path`` (outside code fences), GitHub's ``-1`` suffixes included."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def broken_links(files: list[Path], root: Path = ROOT) -> list[str]:
    """``file: target`` for every relative link whose file, or whose ``#anchor`` in it, does not exist."""
    out = []
    for path in files:
        for m in LINK.finditer(FENCE.sub("", path.read_text())):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                out.append(f"{path.relative_to(root)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return out


def test_every_link_of_the_readme_and_the_docs_resolves():
    assert broken_links(doc_files()) == []


def test_a_broken_file_or_anchor_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A title\n\n## Cache-aware Eq. 1–6 (`kairos+`, `x.prefix_aware`)\n\n"
                                             "## Twice\n\n## Twice\n\n```\n## not a heading\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#cache-aware-eq-16-kairos-xprefix_aware) [ok](docs/a.md#twice-1)\n"
        "[ok](#readme) [web](https://example.com/x) ![img](docs/a.md)\n# Readme\n"
        "[bad](docs/b.md) [bad](docs/a.md#no-such) [bad](docs/a.md#not-a-heading) [bad](#nothing)\n")
    assert broken_links(doc_files(tmp_path), tmp_path) == [
        "README.md: docs/b.md (no such file)", "README.md: docs/a.md#no-such (no such heading)",
        "README.md: docs/a.md#not-a-heading (no such heading)", "README.md: #nothing (no such heading)"]


def test_the_readme_is_a_short_entry_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def test_the_readme_sets_up_with_exactly_the_two_make_targets():
    """The quick start's commands are `make run` and `make test`, both Makefile targets."""
    text = README.read_text()
    quick = text[text.index("## Quick start"):]
    quick = quick[:quick.index("\n## ", 1)]
    block = re.search(r"```bash\n(.*?)```", quick, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"no Makefile target {target}"


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_document_is_linked_from_the_readme(doc):
    assert f"(docs/{doc})" in README.read_text(), f"README.md does not link docs/{doc}"
