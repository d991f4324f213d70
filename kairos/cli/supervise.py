"""``kairos up``'s restart policy: every service that exits is started again, as Docker Compose's
``restart: unless-stopped`` does, until it crash-loops.

* **Every child** — the bundled nats-server (on the same port and store), the state aggregator, the
  node agents, the dispatchers, the ingress, a vLLM engine (the same command) — is restarted when it
  exits, whatever its exit code: a node agent drained by ``kairos drain`` or SIGTERM exits 0 and comes
  back (a rolling restart), one killed comes back too (issue 33; before, only the singletons were).
* **Backoff** and the **crash-loop budget** apply to the other exits (a non-zero code, a signal, or
  exit 0 within :data:`MIN_UPTIME_S` of its start).
* **Backoff**, as Docker's: the n-th restart within the window waits :data:`RESTART_BACKOFF_S` ×
  2^(n−1) (0.1 s, 0.2 s, 0.4 s, …).
* **A clean stop is not a crash**: a child that exits 0 after at least :data:`MIN_UPTIME_S` up (a
  node agent drained by ``kairos drain`` or SIGTERM, issue 33) is started again at once, without
  backoff and outside the budget below, whatever ``--max-restarts`` says (:func:`clean_exit`;
  supervisord's ``startsecs``): drains do not add up to a crash loop.
* **Crash loop**: at most :data:`MAX_SINGLETON_RESTARTS` restarts of one child within
  :data:`RESTART_WINDOW_S` (:class:`RestartBudget`); then it stays down, and ``kairos up`` stops
  everything if nothing can serve without it.

Every restart is announced on stderr with why the child stopped (:func:`exit_reason`: its exit code
or the signal that killed it) and its last log lines.
"""

from __future__ import annotations

import signal

#: how often ``kairos up`` restarts one child within :data:`RESTART_WINDOW_S` before it gives up on it
MAX_SINGLETON_RESTARTS = 5
#: … within this many seconds (a window, as systemd's StartLimitIntervalSec: a child that died five
#: times over a day of serving is restarted again; five deaths in ten minutes is a crash loop)
RESTART_WINDOW_S = 600.0
#: a child must have run this long (s) for its exit 0 to count as a clean stop (a drain), not a crash
MIN_UPTIME_S = 10.0
#: the first restart's delay (s); each further one within the window doubles it (Docker's policy)
RESTART_BACKOFF_S = 0.1


class RestartBudget:
    """At most ``limit`` restarts of one child within any ``window_s`` seconds (monotonic clock).

    ``take(name, now)`` records a restart and returns its rank in the window (1..limit), or None
    when the budget is spent (nothing recorded)."""

    def __init__(self, limit: int = MAX_SINGLETON_RESTARTS, window_s: float = RESTART_WINDOW_S) -> None:
        self.limit, self.window_s = limit, window_s
        self._times: dict[str, list[float]] = {}

    def take(self, name: str, now: float) -> int | None:
        recent = [t for t in self._times.get(name, []) if now - t < self.window_s]
        if len(recent) >= self.limit:
            self._times[name] = recent
            return None
        recent.append(now)
        self._times[name] = recent
        return len(recent)

    def used(self) -> bool:
        """Whether any child was restarted at all."""
        return any(self._times.values())


def clean_exit(returncode: int, uptime_s: float) -> bool:
    """Whether a child's exit is a clean stop (restarted at once, not counted): exit code 0 after at
    least :data:`MIN_UPTIME_S` s up (``uptime_s``). Exit 0 sooner is counted as a crash, so a child
    that keeps exiting 0 at once still ends as crash-looping."""
    return returncode == 0 and uptime_s >= MIN_UPTIME_S


def backoff_s(rank: int) -> float:
    """The delay (s) before the ``rank``-th restart of a child within the window (1-based)."""
    return RESTART_BACKOFF_S * 2 ** (max(rank, 1) - 1)


def exit_reason(returncode: int) -> str:
    """Why a child stopped, from its ``Popen.returncode``: ``exited with code 0 (a clean stop: SIGTERM
    or a drain)``, ``was killed by SIGKILL``, ``exited with code 143 (SIGTERM during its startup, or a second one
    during its drain)``, …"""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    if returncode == 0:
        return "exited with code 0 (a clean stop: SIGTERM, SIGINT or a drain)"
    if returncode > 128:
        try:
            return (f"exited with code {returncode} ({signal.Signals(returncode - 128).name} during its startup, "
                    f"or a second one during its drain)")
        except ValueError:
            pass
    return f"exited with code {returncode}"
