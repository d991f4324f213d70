"""CPU time of a process tree, read from ``/proc`` (Linux): how busy an engine is while idle.

Used by the vLLM tier's idle-engine and engine-core tests and ``bench/vllm_pd_rate.py``. Times are in seconds
of CPU (user + system), from ``/proc/<pid>/task/<tid>/stat`` fields 14 and 15 (``utime``,
``stime``, in clock ticks: ``proc(5)``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now (``/proc/<pid>/task/*/children``)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += _children(p)
    return seen


def find_process(root: int, comm: str) -> int | None:
    """The first process in ``root``'s tree whose name (``/proc/<pid>/comm``) is ``comm``; None: none."""
    for pid in process_tree(root):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == comm:
                return pid
        except OSError:
            continue
    return None


def allowed_cpus(pid: int) -> str:
    """The CPUs the main thread of ``pid`` may run on, as the kernel lists them (``Cpus_allowed_list``
    of ``/proc/<pid>/status``: ``"0"``, ``"0-3"``). Raises OSError when ``pid`` is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[-1]
    raise OSError(f"/proc/{pid}/status has no Cpus_allowed_list")


def thread_cpu_s(pids: list[int]) -> dict[tuple[int, int, str], float]:
    """``{(pid, tid, thread name): CPU seconds}`` of every thread of ``pids`` (gone ones are skipped)."""
    out: dict[tuple[int, int, str], float] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                stat = (task / "stat").read_text()
            except OSError:
                continue
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            out[(pid, int(task.name), name)] = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    return out


@dataclass(frozen=True)
class TreeUsage:
    """CPU use of a process tree over a window.

    Attributes:
        wall_s: the window's length (s). cpu_s: CPU seconds of the whole tree in it.
        busiest: the most used threads, ``(thread name, share of one core)``, highest first.
    """

    wall_s: float
    cpu_s: float
    busiest: tuple[tuple[str, float], ...]

    @property
    def core_share(self) -> float:
        """CPU time ÷ wall time: 1.0 is one core fully busy."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def measure_tree(pid: int, window_s: float, top: int = 3) -> TreeUsage:
    """CPU use of ``pid``'s process tree over ``window_s`` seconds of wall time (blocks that long).

    Raises:
        ValueError: ``window_s`` ≤ 0. ProcessLookupError: ``pid`` does not exist.
    """
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    if not Path(f"/proc/{pid}").exists():
        raise ProcessLookupError(pid)
    pids = process_tree(pid)
    t0, before = time.monotonic(), thread_cpu_s(pids)
    time.sleep(window_s)  # the measurement window itself, not a synchronisation
    after, wall = thread_cpu_s(pids), time.monotonic() - t0
    used = {k: after[k] - before.get(k, 0.0) for k in after}
    busiest = sorted(((k[2], v / wall) for k, v in used.items()), key=lambda kv: -kv[1])[:top]
    return TreeUsage(wall_s=wall, cpu_s=sum(used.values()), busiest=tuple(busiest))


__all__ = ["process_tree", "find_process", "allowed_cpus", "thread_cpu_s", "measure_tree", "TreeUsage"]
