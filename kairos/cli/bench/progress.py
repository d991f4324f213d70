"""Progress of a ``kairos bench`` run on stderr: a tqdm bar on a terminal, else periodic lines.

Inputs: from the replay (:func:`kairos.cli.bench.client.run_bench`): :meth:`ProgressReporter.started`
when a request goes out (its index, its target output tokens, the
chunk list of the :class:`~kairos.cli.bench.stream.StreamState` its stream fills; the last one sent
marks the end of the sending, :meth:`ProgressReporter.all_sent`), :meth:`ProgressReporter.update`
when it finishes (with the failures so far), and :meth:`ProgressReporter.tick` about once a second. Outputs: a tqdm bar when the stream is
a terminal, else one plain line every ``interval_s`` seconds, one when every request has been sent
and one at the end (so a run redirected to a file, e.g. under ``make run``, still shows it is
alive). Once every request is out, the line names the requests still streaming — the ones the run
is waiting for — with their output tokens so far ÷ their target and a time left estimated from
their own token rate (:func:`progress_line`, pure).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_PROGRESS_INTERVAL_S = 10.0  #: progress line period when stderr is not a terminal, seconds
NAMED_MAX = 3  #: requests named in a progress line (the ones with the most output tokens left)


@dataclass(frozen=True)
class Streaming:
    """A request still in flight: its index in the workload, output tokens received so far and
    requested (``max_tokens``), and the seconds left at its own token rate so far (None: fewer
    than two tokens yet)."""

    index: int
    tokens: int
    target: int
    eta_s: float | None = None


def streaming(index: int, target: int, chunks: Sequence[tuple[float, int]]) -> Streaming:
    """A :class:`Streaming` from a request's content chunks (``(time_s, tokens)``, one clock): the
    time left is (target − tokens) × the mean time per token after the first one."""
    tokens = sum(n for _, n in chunks)
    eta = None
    if tokens >= 2 and chunks[-1][0] > chunks[0][0]:
        eta = max(target - tokens, 0) * (chunks[-1][0] - chunks[0][0]) / (tokens - chunks[0][1])
    return Streaming(index, tokens, target, eta)


def _one(s: Streaming, first: bool) -> str:
    unit = " output tokens" if first else ""
    left = "" if s.eta_s is None else f" (~{s.eta_s:,.0f} s left)"
    if s.tokens == 0:
        return f"#{s.index} waiting for its first of {s.target:,}{unit}"
    return f"#{s.index} at {s.tokens:,}/{s.target:,}{unit}{left}"


def progress_line(done: int, total: int, failed: int, elapsed_s: float, *, sent: int | None = None,
                  sent_by_s: float | None = None, inflight: Sequence[Streaming] = ()) -> str:
    """One progress line. While requests are still being sent: done, failed, elapsed and how many
    were sent. Once all were (``sent_by_s`` = when the last one went out, s since the start): the
    requests still streaming, the :data:`NAMED_MAX` with the most output tokens left named with
    their tokens so far ÷ target and time left — why the run goes on after the workload's window.
    """
    head = f"bench: {done}/{total} requests done, {failed} failed, {elapsed_s:,.0f} s elapsed"
    if sent_by_s is None:
        return head + (f" ({sent} sent so far, {sent - done} in flight)" if sent is not None else "")
    head += f"; all {total} sent in the first {sent_by_s:,.0f} s"
    if not inflight:
        return head
    waiting = sorted(inflight, key=lambda s: (-(s.target - s.tokens), s.index))
    named = ", ".join(_one(s, i == 0) for i, s in enumerate(waiting[:NAMED_MAX]))
    more = f" (+{len(waiting) - NAMED_MAX} more)" if len(waiting) > NAMED_MAX else ""
    return f"{head}; {len(waiting)} still streaming: {named}{more}"


class ProgressReporter:
    """Progress of a run on stderr: a tqdm bar when stderr is a terminal, else one plain line every
    ``interval_s`` seconds (and one when all requests are sent, one at the end), so a redirected
    run still shows it is alive and, at its end, what it is waiting for."""

    def __init__(self, total: int, *, enabled: bool, interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
                 stream=None, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.done, self.failed, self.sent = total, 0, 0, 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled, self.interval_s, self.clock = enabled, interval_s, clock
        self.t0 = self.last = clock()
        self.printed: tuple[int, bool] | None = None  #: (done, all sent) at the last progress line
        self.sent_by_s: float | None = None  #: when the last request was sent, seconds since t0
        #: index → (target output tokens, its chunks so far: StreamState.chunks, filled by the stream)
        self.inflight: dict[int, tuple[int, list[tuple[float, int]]]] = {}
        self.bar = None
        if enabled and _isatty(self.stream):
            from tqdm import tqdm
            self.bar = tqdm(total=total, unit="req", desc="bench", file=self.stream, dynamic_ncols=True)

    def started(self, index: int, target: int, chunks: list[tuple[float, int]]) -> None:
        """Request ``index`` was sent, asking for ``target`` output tokens; ``chunks`` is the list its
        stream appends ``(time_s, tokens)`` to (read, never written, here)."""
        self.sent += 1
        self.inflight[index] = (target, chunks)
        if self.sent == self.total:
            self.all_sent()

    def update(self, failed: int, index: int | None = None) -> None:
        """One more request finished (``index``, if known); ``failed`` is the failure count so far."""
        self.done += 1
        self.failed = failed
        if index is not None:
            self.inflight.pop(index, None)
        if self.bar is not None:
            self.bar.set_postfix_str(self._postfix(), refresh=False)
            self.bar.update(1)
        else:
            self.tick()

    def all_sent(self) -> None:
        """The last request has been sent: say so now (the run goes on while requests stream)."""
        self.sent_by_s = self.clock() - self.t0
        if self.bar is None and self.enabled and self.done < self.total:
            self._line()

    def tick(self) -> None:
        """Periodic call (about once a second): a line when ``interval_s`` passed since the last one
        (no terminal), else refresh the bar's postfix (the streaming requests' tokens move on)."""
        if self.bar is not None:
            self.bar.set_postfix_str(self._postfix(), refresh=True)
        elif self.enabled and self.clock() - self.last >= self.interval_s:
            self._line()

    def snapshot(self) -> list[Streaming]:
        """The requests in flight now (copies the chunk lists' lengths at this instant)."""
        return [streaming(i, target, list(chunks)) for i, (target, chunks) in list(self.inflight.items())]

    def line(self) -> str:
        """The progress line for now (:func:`progress_line`)."""
        return progress_line(self.done, self.total, self.failed, self.clock() - self.t0, sent=self.sent or None,
                             sent_by_s=self.sent_by_s, inflight=self.snapshot() if self.sent_by_s is not None else ())

    def _postfix(self) -> str:
        text = f"failed={self.failed}"
        if self.sent_by_s is not None and 0 < len(self.inflight) <= NAMED_MAX:
            text += "; waiting on " + ", ".join(f"#{s.index} {s.tokens}/{s.target} tok" for s in self.snapshot())
        return text

    def _line(self) -> None:
        self.last = self.clock()
        self.printed = (self.done, self.sent_by_s is not None)
        print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.printed != (self.done, self.sent_by_s is not None):
            self._line()


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
