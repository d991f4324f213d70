"""The mutation tier: how many one-line bugs planted in the safety core the unit tests catch.

    python bench/mutation.py [--modules PATH ...] [--max-children N] [--json PATH] [--check]
    make mutation          # every module, then --check; recorded: bench/results/mutation.jsonl

mutmut 3 (pinned in ``requirements-dev.txt``; its configuration, the list of safety-critical modules
and the tests it runs, is ``[tool.mutmut]`` in ``pyproject.toml``) writes every mutant of those
modules — an operator flipped, a constant changed, a call's argument dropped, a ``return`` replaced
— and runs, for each, the unit tests that execute the mutated function; a mutant is *killed* when
one of them fails, *timeout* when they hang (15× their clean time: detected too), *survived* when
all pass. This script runs it and reports, per module, killed / timeout / survived / no tests and
each survivor with its diff.

A survivor that no test can kill, because the mutant behaves exactly like the original (e.g. a
default that every caller overrides, a ``<`` that becomes ``<=`` where equality cannot occur), is
listed with the reason in ``tests/mutation/*.toml``: one ``[[equivalent]]`` table per mutant with
the mutated ``function`` (dotted), the line ``removed`` and the line ``added`` (as mutmut's diff shows
them, stripped) and ``why``. Matching is by those three, not by mutmut's mutant number, so a list
entry outlives edits elsewhere in the function.

Score per module: (killed + timeout) ÷ (mutants − listed equivalents). ``--check`` exits 1 when a
module scores under ``TARGET`` (0.90) or has a survivor that is not listed; the table is printed
either way, and with ``--json`` the rows are written for ``python -m tools.docgen record mutation``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.90
EQUIVALENTS = ROOT / "tests" / "mutation"


def configured_modules(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """The module paths of ``[tool.mutmut].only_mutate`` (relative, ``/``-separated)."""
    return list(tomllib.loads(pyproject.read_text())["tool"]["mutmut"]["only_mutate"])


def function_of(mutant: str) -> str:
    """The dotted function a mutmut 3 mutant name mutates: ``kairos.core.cluster.heartbeat.xǁLivenessǁheard__mutmut_3``
    → ``kairos.core.cluster.heartbeat.Liveness.heard``; ``kairos.core.cluster.routing.x_make_job__mutmut_1`` → ``kairos.core.cluster.routing.make_job``."""
    head, _, _ = mutant.rpartition("__mutmut_")
    module, _, name = head.rpartition(".")
    if name.startswith("xǁ"):
        cls, _, meth = name[2:].partition("ǁ")
        return f"{module}.{cls}.{meth}"
    return f"{module}.{name[2:]}" if name.startswith("x_") else f"{module}.{name}"


def changed_lines(diff: str) -> tuple[str, str]:
    """(removed, added) of a unified diff: its ``-``/``+`` lines, stripped and joined by `` / ``."""
    lines = diff.splitlines()
    removed = [x[1:].strip() for x in lines if x.startswith("-") and not x.startswith("---")]
    added = [x[1:].strip() for x in lines if x.startswith("+") and not x.startswith("+++")]
    return " / ".join(removed), " / ".join(added)


@dataclass(frozen=True)
class Equivalent:
    """One listed equivalent mutant (a ``[[equivalent]]`` table of ``tests/mutation/*.toml``)."""

    function: str
    removed: str
    added: str
    why: str
    source: str = ""

    def matches(self, function: str, removed: str, added: str) -> bool:
        return (self.function, self.removed, self.added) == (function, removed, added)


def load_equivalents(folder: Path = EQUIVALENTS) -> list[Equivalent]:
    """Every ``[[equivalent]]`` of ``folder/*.toml``. Raises ``ValueError`` naming the file and entry
    when one lacks ``function``, ``removed``, ``added`` or a non-empty ``why``."""
    out: list[Equivalent] = []
    for path in sorted(folder.glob("*.toml")):
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path.name}: {exc}") from None
        if set(data) - {"equivalent"}:
            raise ValueError(f"{path.name}: unknown table(s) {sorted(set(data) - {'equivalent'})} (only [[equivalent]])")
        for i, e in enumerate(data.get("equivalent", [])):
            missing = [k for k in ("function", "removed", "added", "why") if not isinstance(e.get(k), str)]
            if missing or not e["why"].strip():
                raise ValueError(f"{path.name} entry {i + 1}: needs function, removed, added and a reason (why)")
            if set(e) - {"function", "removed", "added", "why"}:
                raise ValueError(f"{path.name} entry {i + 1}: unknown key(s) {sorted(set(e) - {'function', 'removed', 'added', 'why'})}")
            out.append(Equivalent(e["function"], e["removed"], e["added"], e["why"], path.name))
    return out


@dataclass
class ModuleResult:
    """One module's mutants by outcome (mutmut's status names) and its survivors."""

    module: str
    mutants: int = 0
    killed: int = 0
    timeout: int = 0
    survived: int = 0
    no_tests: int = 0
    not_checked: int = 0
    other: int = 0
    equivalent: int = 0
    survivors: list[dict] = field(default_factory=list)

    @property
    def score(self) -> float:
        """(killed + timeout) ÷ (mutants run − listed equivalents); 0.0 when nothing was run."""
        den = self.mutants - self.not_checked - self.equivalent
        return (self.killed + self.timeout) / den if den > 0 else 0.0

    @property
    def complete(self) -> bool:
        """Every mutant of the module was run (and there are some)."""
        return self.mutants > 0 and self.not_checked == 0

    @property
    def unexplained(self) -> list[dict]:
        return [s for s in self.survivors if not s.get("equivalent")]

    def row(self) -> dict:
        return {**asdict(self), "score": round(self.score, 4)}


def collect(modules: list[str], equivalents: list[Equivalent]) -> list[ModuleResult]:
    """Read mutmut's per-file results (``mutants/<module>.meta``) and diff every mutant that was not
    detected. Must run in the repository root after ``mutmut run``."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    out = []
    for module in modules:
        meta = ROOT / "mutants" / f"{module}.meta"
        res = ModuleResult(module)
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.is_file() else {}
        for name, code in sorted(codes.items()):
            status = status_by_exit_code[code]
            res.mutants += 1
            if status in ("killed", "timeout"):
                setattr(res, status, getattr(res, status) + 1)
                continue
            if status == "not checked":  # not run (yet): neither detected nor a survivor
                res.not_checked += 1
                continue
            if status == "survived":
                res.survived += 1
            elif status == "no tests":
                res.no_tests += 1
            else:
                res.other += 1
            diff = get_diff_for_mutant(name, path=module)
            fn = function_of(name)
            removed, added = changed_lines(diff)
            eq = next((e for e in equivalents if e.matches(fn, removed, added)), None)
            res.equivalent += eq is not None
            res.survivors.append({"mutant": name, "status": status, "function": fn, "removed": removed,
                                  "added": added, "equivalent": eq.why if eq else None, "diff": diff})
        out.append(res)
    return out


def forget_results(modules: list[str], mutants: Path | None = None) -> list[Path]:
    """Remove what mutmut recorded for ``modules`` — the mutated copy ``mutants/<module>`` and its
    results ``mutants/<module>.meta`` — so that it writes their mutants again and tests each of them.
    mutmut 3 keeps a mutant's exit code in the ``.meta`` and tests it again only when its function's
    source changes: after a test was added, a survivor it kills stays a survivor (seen with issue 33's
    tests of lifecycle.py); and the copy must go with it, as mutmut reads an unchanged copy's mutants
    from the ``.meta``. Returns the files removed."""
    root = ROOT / "mutants" if mutants is None else mutants
    gone = [p for m in modules for p in (root / m, root / f"{m}.meta") if p.is_file()]
    for path in gone:
        path.unlink()
    return gone


def sync_copies(mutants: Path | None = None) -> list[Path]:
    """Bring ``mutants/kairos`` and ``mutants/tests`` in line with the checkout where mutmut does not:
    it copies the tree in but never deletes (a test module deleted since the last run was still
    collected there, and failed to import what was deleted with it), and it copies a file that is not
    Python once and never again (a stale ``error_codes.toml`` failed the docs test there). Copies of
    files the checkout no longer has are removed; a non-Python copy that differs is copied again;
    Python files are mutmut's own (it compares their times), and so are its results (``.meta``). Returns
    the paths removed or refreshed."""
    root = ROOT / "mutants" if mutants is None else mutants
    changed = []
    for top in ("kairos", "tests"):
        if not (root / top).is_dir():
            continue
        for copy in [p for p in (root / top).rglob("*") if p.is_file() and p.suffix != ".meta"]:  # .meta: results
            src = ROOT / copy.relative_to(root)
            if not src.exists():
                copy.unlink()
            elif copy.suffix != ".py" and src.read_bytes() != copy.read_bytes():
                shutil.copy2(src, copy)
            else:
                continue
            changed.append(copy)
    return changed


def mutant_globs(modules: list[str]) -> list[str]:
    """mutmut name patterns for ``modules`` (``kairos/core/cluster/arbiter.py`` → ``kairos.core.cluster.arbiter.*``)."""
    return [module.removesuffix(".py").replace("/", ".") + ".*" for module in modules]


def table(results: list[ModuleResult]) -> str:
    lines = [f"{'module':42} {'mutants':>7} {'killed':>6} {'t/o':>4} {'surv':>5} {'equiv':>5} {'score':>6}"]
    for r in results:
        flag = "" if r.complete and r.score >= TARGET and not r.unexplained else "  <-- "
        if flag:
            flag += ("no mutants: not run (or not a configured module)" if r.mutants == 0 else
                     f"{r.not_checked} not run yet" if r.not_checked else
                     f"under {TARGET:.0%}" if r.score < TARGET else f"{len(r.unexplained)} unexplained")
        lines.append(f"{r.module:42} {r.mutants:7d} {r.killed:6d} {r.timeout:4d} {r.survived + r.no_tests + r.other:5d} "
                     f"{r.equivalent:5d} {r.score:6.1%}{flag}")
    return "\n".join(lines)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", nargs="+", metavar="PATH",
                    help="only these of [tool.mutmut].only_mutate (default: all of them)")
    ap.add_argument("--max-children", type=_positive, default=2, help="parallel mutant runs (default 2)")
    ap.add_argument("--json", type=Path, help="write the rows (one per module) to this file")
    ap.add_argument("--check", action="store_true",
                    help=f"exit 1 if a module was not run in full, scores under {TARGET * 100:.0f} %% or has an unlisted survivor")
    ap.add_argument("--no-run", action="store_true", help="report the last run's results (mutants/) only")
    args = ap.parse_args(argv)
    known = configured_modules()
    modules = list(dict.fromkeys(args.modules)) if args.modules else known
    unknown = [m for m in modules if m not in known]
    if unknown:
        ap.error(f"not in [tool.mutmut].only_mutate of pyproject.toml: {', '.join(unknown)}")
    try:
        equivalents = load_equivalents()
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        print(f"mutation: {exc}", file=sys.stderr)
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json: no folder {args.json.parent}")
    t0 = time.monotonic()
    if not args.no_run:
        sync_copies()  # files deleted or changed in the checkout since the last run
        forget_results(modules)  # every mutant tested against today's tests, none carried over
        names = [] if args.modules is None else mutant_globs(modules)
        cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *names]
        rc = subprocess.run(cmd, cwd=ROOT, stdout=sys.stderr).returncode  # its progress, not rows
        if rc != 0:
            print(f"mutation: {' '.join(cmd)} exited with {rc} (run it by hand to see why)", file=sys.stderr)
            return 2
    wall_s = time.monotonic() - t0
    results = collect(modules, equivalents)
    print(table(results), file=sys.stderr)
    for r in results:
        for s in r.unexplained:
            print(f"\n{s['status']}: {s['mutant']}\n{s['diff']}", file=sys.stderr)
    stale = [e for e in equivalents if not any(e.matches(s["function"], s["removed"], s["added"])
                                              for r in results for s in r.survivors)
             and any(e.function.startswith(r.module.removesuffix(".py").replace("/", ".") + ".") for r in results)]
    for e in stale:
        print(f"note: {e.source}: {e.function} `{e.removed}` -> `{e.added}` matches no survivor now", file=sys.stderr)
    took = "(results of the last run)" if args.no_run else f"in {wall_s:.0f} s"
    print(f"\n{sum(r.mutants for r in results)} mutants {took}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([{**r.row(), "wall_s": round(wall_s, 1)} for r in results], indent=1))
    bad = [r for r in results if not r.complete or r.score < TARGET or r.unexplained]
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
