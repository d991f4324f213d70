"""Progress of a ``kairos bench`` run on stderr: a tqdm bar on a terminal, else periodic lines.

Inputs: one :meth:`ProgressReporter.update` per finished request (with the failures so far) from
the replay (:func:`kairos.cli.bench.client.run_bench`). Outputs: a tqdm bar when the stream is a
terminal, else one plain line every ``interval_s`` seconds and one at the end (so a run redirected
to a file, e.g. under ``make run``, still shows it is alive).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

DEFAULT_PROGRESS_INTERVAL_S = 10.0  #: progress line period when stderr is not a terminal, seconds


class ProgressReporter:
    """Progress of a run on stderr: a tqdm bar when stderr is a terminal, else one plain line every
    ``interval_s`` seconds (and one at the end), so a redirected run still shows it is alive."""

    def __init__(self, total: int, *, enabled: bool, interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
                 stream=None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.done, self.failed = total, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled, self.interval_s, self.clock = enabled, interval_s, clock
        self.t0 = self.last = clock()
        self.printed = -1  #: ``done`` at the last progress line
        self.bar = None
        if enabled and _isatty(self.stream):
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="req", desc="bench", file=self.stream, dynamic_ncols=True)

    def update(self, failed: int) -> None:
        """One more request finished; ``failed`` is the failure count so far."""
        self.done += 1
        self.failed = failed
        if self.bar is not None:
            self.bar.set_postfix(failed=failed, refresh=False)
            self.bar.update(1)
        elif self.enabled and self.clock() - self.last >= self.interval_s:
            self.last = self.clock()
            self._line()

    def _line(self) -> None:
        self.printed = self.done
        print(f"bench: {self.done}/{self.total} requests done, {self.failed} failed, "
              f"{self.clock() - self.t0:.0f} s elapsed", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.printed != self.done:
            self._line()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
