"""Result files: the committed measurements every generated figure is rendered from.

A measured figure lives in ``bench/results/<name>.jsonl`` (JSON Lines): first a ``{"meta": {...}}``
line — the command, UTC date, machine (CPU count and model, platform), the 1-minute load average
before and after, wall seconds, git commit — then one line per result row, exactly as the command
printed it (the benchmarks' JSON lines) or as it wrote it with ``--json`` (``kairos
sim``/``bench``/``demo``). A file without the meta line (e.g. ``python bench/control_plane.py >
bench/results/control-plane.jsonl``) is read too. :func:`record` runs a command and writes one
(``python -m tools.docgen record NAME -- COMMAND``); benchmarks that write their own use
:func:`result_meta` and :func:`write_result`.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"


class DocgenError(Exception):
    """A result file is missing or malformed, or a block names no renderer."""


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


#: what every block renderer is given: result name → :class:`Result` (``load_result`` on one folder)
Load = Callable[[str], Result]


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (its constants: targets the benchmark itself checks, its
    helpers that read its own rows). ``bench/`` is not a package, so it is loaded from its path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what :mod:`platform` knows."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:  # not Linux: no /proc
        lines = []
    for line in lines:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    """The short hash of HEAD, or None outside a git checkout."""
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
