"""Closed-loop step-latency correction: per node, how far the real steps are from the model's
predictions, learned online from the nodes' step records (issue 9, item 5; docs/policies.md
"Closed-loop model correction").

Where data comes from: every executed engine step's (predicted ms, actual ms) — in the live system
the node agents publish them as :class:`kairos.contracts.wire.StepRecordEvent` on ``kairos.steps.<node>`` and
the state aggregator feeds them here; in the simulator the engines' step ends do. Where it goes:
one :class:`StepCorrection` per node in the cluster view (``NodeView.correction``), so every
dispatcher replica applies the same numbers; the simulator puts them into its snapshots the same
way. The policy (``kairos+``, ``PolicyParams.model_correction``) applies them in Eq. 1–6.

Estimator (why this one, see docs/policies.md): the log-residual ``x = ln(actual / predicted)`` of
each step over a sliding time window. With mean ``m`` and standard deviation ``s`` over the ``n``
steps of the window:

* ``bias = mean(actual / predicted)`` scales the TTFT estimates (Eq. 1–3, Eq. 6): an unbiased
  multiplicative correction of the expected time;
* ``safety = exp(m + z_q · s · sqrt(1 + 1/n))`` scales the Eq. 5 check (``T·safety ≤ β·τ``): the
  upper ``q`` prediction bound of the next step's ratio if the log-residuals are normal
  (multiplicative noise), so a step predicted at the limit exceeds it with probability ≈ 1 − q.
  The margin is learned from the residual spread instead of a fixed β. A drift inside the window
  widens ``s`` (a mixture of two levels), so the margin is conservative while the window catches up.

Decode nodes keep a second window of their mixed steps only (decodes + a prefill chunk: the steps
Eq. 5 bounds). When the truth differs from the model in *form*, the ratio depends on the batch
composition, and a pooled window dominated by decode-only steps would understate the error of the
steps near the limit; so ``safety`` is the larger of the two windows' bounds and ``bias`` the mixed
window's mean, as soon as it holds ``min_samples`` steps. Mixed steps are rarer (a few per second),
so their window is ``mixed_window_factor`` × longer; taking the larger bound keeps the pooled
window's fast reaction to a drift.

An empirical quantile would need ~1/(1 − q) = 1,000 steps per window for q = 0.999, i.e. a window
of minutes that would react to a drift far too slowly; the parametric bound needs tens.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import NormalDist

import msgspec

#: bounds of the factors (a runaway estimate must not make a node look free or unusable forever)
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0


class StepCorrection(msgspec.Struct, frozen=True, kw_only=True):
    """One node's learned correction of the latency model (travels in the cluster view).

    Attributes:
        bias: mean of actual / predicted step ms over the window (1.0: the model is right on average).
        safety: upper prediction bound of actual / predicted (Eq. 5 margin; ≥ bias when noisy).
        samples: steps in the window (0: no data, factors are 1.0).
        window_ms: the window length the numbers were computed over, ms.
    """

    bias: float = 1.0
    safety: float = 1.0
    samples: int = 0
    window_ms: float = 0.0


IDENTITY = StepCorrection()


@dataclass
class _Window:
    items: deque = field(default_factory=deque)  # (t_ms, x, ratio)
    s1: float = 0.0
    s2: float = 0.0
    sr: float = 0.0


class CorrectionEstimator:
    """Sliding-window log-residual statistics per node; O(1) amortized per step.

    Args:
        window_ms: steps older than this (ms, same clock as ``t_ms``) leave the window.
        min_samples: below this many steps in the window a node gets :data:`IDENTITY`.
        quantile: q of the safety bound (0.999: a step predicted at β·τ exceeds it 0.1 % of the time).
        max_samples: cap on the window's steps (oldest dropped first).
        mixed_window_factor: the mixed-step window is this × ``window_ms``.

    Raises:
        ValueError: a non-positive window, min_samples < 2 or q outside (0.5, 1).
    """

    def __init__(self, window_ms: float = 10_000.0, min_samples: int = 30, quantile: float = 0.999,
                 max_samples: int = 4096, mixed_window_factor: float = 3.0) -> None:
        if not window_ms > 0 or min_samples < 2 or not 0.5 < quantile < 1.0 or max_samples < min_samples:
            raise ValueError("need window_ms > 0, min_samples >= 2, 0.5 < quantile < 1, max_samples >= min_samples")
        self.window_ms, self.min_samples, self.quantile, self.max_samples = window_ms, min_samples, quantile, max_samples
        self.z = NormalDist().inv_cdf(quantile)
        self.mixed_window_ms = window_ms * max(mixed_window_factor, 1.0)
        self._w: dict[str, _Window] = {}
        self._mixed: dict[str, _Window] = {}
        self._last: dict[str, StepCorrection] = {}

    def observe(self, node: str, predicted_ms: float, actual_ms: float, t_ms: float, mixed: bool = False) -> bool:
        """Add one executed step of ``node`` ending at ``t_ms``; ``mixed``: it ran decodes and a
        prefill chunk together. Steps with a non-positive or non-finite time are ignored (returns
        False)."""
        if not (predicted_ms > 0 and actual_ms > 0 and math.isfinite(predicted_ms) and math.isfinite(actual_ms)):
            return False
        r = actual_ms / predicted_ms
        x = math.log(r)
        for windows in ((self._w, self._mixed) if mixed else (self._w,)):
            w = windows.get(node)
            if w is None:
                w = windows[node] = _Window()
            w.items.append((t_ms, x, r))
            w.s1 += x
            w.s2 += x * x
            w.sr += r
            if len(w.items) > self.max_samples:
                self._pop(w)
        return True

    @staticmethod
    def _pop(w: _Window) -> None:
        _, x, r = w.items.popleft()
        w.s1 -= x
        w.s2 -= x * x
        w.sr -= r

    def _count(self, w: _Window | None, now_ms: float, window_ms: float) -> int:
        """Steps in one window after dropping those older than ``window_ms``."""
        if w is None:
            return 0
        cutoff = now_ms - window_ms
        while w.items and w.items[0][0] < cutoff:
            self._pop(w)
        n = len(w.items)
        if n == 0:  # re-anchor the running sums (no float residue builds up over a long run)
            w.s1 = w.s2 = w.sr = 0.0
        return n

    def _factors(self, w: _Window) -> tuple[float, float]:
        """(bias, safety) of a window of at least ``min_samples`` (≥ 2) steps."""
        n = len(w.items)
        m = w.s1 / n
        s = math.sqrt(max(w.s2 / n - m * m, 0.0) * n / (n - 1))
        return w.sr / n, math.exp(m + self.z * s * math.sqrt(1.0 + 1.0 / n))

    def correction(self, node: str, now_ms: float) -> StepCorrection:
        """The node's correction from the steps of the last ``window_ms`` before ``now_ms``:
        :data:`IDENTITY` factors until ``min_samples`` steps were ever in the window; when fewer
        are in it later (the node idled), the last correction computed (no new data is not
        evidence that the model became right)."""
        n = self._count(self._w.get(node), now_ms, self.window_ms)
        if n < self.min_samples:  # too few recent steps (e.g. the node idled): keep what was learned last
            last = self._last.get(node)
            return StepCorrection(bias=last.bias if last else 1.0, safety=last.safety if last else 1.0, samples=n,
                                  window_ms=self.window_ms)
        bias, safety = self._factors(self._w[node])
        if self._count(self._mixed.get(node), now_ms, self.mixed_window_ms) >= self.min_samples:
            bias_m, safety_m = self._factors(self._mixed[node])
            bias, safety = bias_m, max(safety, safety_m)
        c = StepCorrection(bias=min(max(bias, MIN_FACTOR), MAX_FACTOR),
                           safety=min(max(safety, MIN_FACTOR), MAX_FACTOR), samples=n, window_ms=self.window_ms)
        self._last[node] = c
        return c

    def corrections(self, now_ms: float) -> dict[str, StepCorrection]:
        """node → correction, for every node that reported a step."""
        return {node: self.correction(node, now_ms) for node in list(self._w)}
