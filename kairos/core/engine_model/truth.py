"""Ground truth of an engine's step times, independent of the latency model the policy believes.

Where it is used: the simulator gives every node one :class:`GroundTruth` (``kairos sim
--truth-profile/--truth-scale/--drift``); the emulated node agent can run one too
(``KAIROS_TRUTH_PROFILE``/``KAIROS_TRUTH_SCALE``), so that ``kairos profile`` has something to
recover that is not the model the node reports predictions with. The engine model
(:class:`kairos.core.engine_model.Engine`) plans a step with its *belief* (``model``: predictions, the
node-side guard) and advances the clock by the *truth* (this class), plus the optional per-step
noise. Without a truth the two coincide, and "0 TBT violations" would be true by construction.

Forms of model error (issue 9, item 4):

* **form** — ``model`` is another artifact (``--truth-profile``, e.g. a measured one), so the error
  depends on the batch composition, not only a factor;
* **bias** — ``scale`` multiplies every step (``--truth-scale 1.1``: 10 % slower than the model);
* **drift** — from ``drift_at_ms`` on (the node's clock) steps take ``drift_scale`` × longer
  (``--drift decode-0:15:300``: decode-0 becomes 15 % slower 300 s into the run);
* **noise** — per step, applied by the caller (the simulator's seeded log-normal ``step_noise``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kairos.core.model.latency import LatencyModel


@dataclass
class GroundTruth:
    """The step time a node really takes (ms), as a function of the step's composition and time.

    Attributes:
        model: the latency artifact that is the truth's form (may differ from the policy's).
        scale: systematic factor on every step (> 0); 1.1 = 10 % slower than ``model``.
        drift_scale: extra factor from ``drift_at_ms`` on (> 0); 1.15 = 15 % slower.
        drift_at_ms: node-clock time (ms) the drift starts; ``inf``: never.
        clock: returns the node's current time in ms (the simulator's virtual clock, or wall
            time since the backend started); only read when a drift is set.

    Raises:
        ValueError: a non-positive or non-finite factor.
    """

    model: LatencyModel
    scale: float = 1.0
    drift_scale: float = 1.0
    drift_at_ms: float = math.inf
    clock: Callable[[], float] | None = None

    def __post_init__(self) -> None:
        for name in ("scale", "drift_scale"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"truth {name} must be a finite number > 0, got {v!r}")

    def factor(self) -> float:
        """The multiplicative factor on ``model`` now (scale × drift once it started)."""
        f = self.scale
        if self.drift_scale != 1.0 and self.clock is not None and self.clock() >= self.drift_at_ms:
            f *= self.drift_scale
        return f

    def step_ms(self, batch_size: int, kv_tokens: int, prefill_tokens: int, prefill_cached: float) -> float:
        """True latency (ms) of a step with B decodes over K KV tokens and ``prefill_tokens`` new
        prompt tokens after ``prefill_cached`` cached ones (same arguments as
        :meth:`LatencyModel.step_ms`)."""
        return self.model.step_ms(batch_size, kv_tokens, prefill_tokens, prefill_cached) * self.factor()
