"""How much slower (or faster) the engines ran than their latency profile during a live run, and
how many of their decode steps broke the TBT SLO.

The state aggregator sums, per node, the measured and the predicted time of every step record
(``kairos_aggregator_step_seconds_total{node, clock="measured"|"predicted"}``) and keeps a
histogram of the steps that carried decodes (``kairos_aggregator_decode_step_seconds``, the TBT SLO
τ a bucket boundary). :class:`StepScaleSampler` reads the aggregator's ``/metrics`` once when a
benchmark starts and once when it ends; in between:

* a node's **step-time scale** is Σ measured ÷ Σ predicted of its steps (every step, long prefill
  steps included: the aggregator's windowed correction ``kairos.core.model.correction`` needs 30 steps per
  10 s window, which a prefill node running 350 ms steps never has). The demo reports it beside its
  fidelity table and re-runs the simulator at those step times (``truth_scale`` / ``drift``) to
  show how much of a live ÷ simulated gap the engines' own speed explains;
* the **TBT violation rate** is the share of decode steps above τ, as the simulator counts it
  (Table 4: "% of decode steps"), beside the client's share of inter-token gaps above τ.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

HISTOGRAM = "kairos_aggregator_decode_step_seconds"
STEP_TIME = "kairos_aggregator_step_seconds_total"
STEPS = "kairos_aggregator_node_steps_total"
#: a node needs this many steps in the run for a scale (fewer: no estimate, not the identity)
MIN_STEPS = 10


def parse_decode_steps(text: str, tbt_slo_ms: float) -> dict[str, tuple[float, float]] | None:
    """``{node: (decode steps, decode steps ≤ τ)}`` from the histogram :data:`HISTOGRAM` in a
    Prometheus exposition ``text`` (buckets in seconds); ``tbt_slo_ms`` (τ, **ms**) must be one of
    its bucket boundaries (the aggregator's ``tbt_slo_ms`` makes it one). None if the histogram is absent or has no
    bucket at τ (an aggregator configured without it: no exact count exists).

    Raises:
        ValueError: ``text`` is not the Prometheus text format.
    """
    counts: dict[str, float] = {}
    le_tau: dict[str, float] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        if family.name != HISTOGRAM:
            continue
        seen = True
        for sample in family.samples:
            node, le = sample.labels.get("node"), sample.labels.get("le")
            if sample.name == HISTOGRAM + "_count":
                counts[node] = sample.value
            elif (sample.name == HISTOGRAM + "_bucket" and le not in (None, "+Inf")
                  and abs(float(le) * 1000.0 - tbt_slo_ms) < 1e-6):
                le_tau[node] = sample.value
    if not seen or set(le_tau) != set(counts):
        return None
    return {n: (c, le_tau[n]) for n, c in counts.items()}


def violation_rate(before: dict[str, tuple[float, float]] | None,
                   after: dict[str, tuple[float, float]] | None) -> float | None:
    """Share in [0, 1] of the decode steps counted between two :func:`parse_decode_steps` snapshots
    that took longer than τ, over all nodes; None without both snapshots or without a step."""
    if before is None or after is None:
        return None
    steps = sum(c - before.get(n, (0.0, 0.0))[0] for n, (c, _) in after.items())
    within = sum(le - before.get(n, (0.0, 0.0))[1] for n, (_, le) in after.items())
    return (steps - within) / steps if steps > 0 else None


def parse_step_times(text: str) -> dict[str, tuple[float, float, float]]:
    """``{node: (steps, Σ measured s, Σ predicted s)}`` from the aggregator's :data:`STEPS` and
    :data:`STEP_TIME` counters in a Prometheus exposition ``text`` (``{}`` without them).

    Raises:
        ValueError: ``text`` is not the Prometheus text format.
    """
    steps: dict[str, float] = {}
    clocks: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            node = sample.labels.get("node")
            if sample.name == STEPS and node:
                steps[node] = sample.value
            elif sample.name == STEP_TIME and node:
                clocks[(node, sample.labels.get("clock", ""))] = sample.value
    return {n: (c, clocks.get((n, "measured"), 0.0), clocks.get((n, "predicted"), 0.0)) for n, c in steps.items()}


def step_scales(before: dict[str, tuple[float, float, float]], after: dict[str, tuple[float, float, float]],
                min_steps: int = MIN_STEPS) -> dict[str, float]:
    """``{node: Σ measured ÷ Σ predicted}`` over the steps between two :func:`parse_step_times`
    snapshots; nodes with fewer than ``min_steps`` steps in between (or none predicted) are absent."""
    out: dict[str, float] = {}
    for n, (c, m, p) in sorted(after.items()):
        c0, m0, p0 = before.get(n, (0.0, 0.0, 0.0))
        if c - c0 >= min_steps and p - p0 > 0:
            out[n] = (m - m0) / (p - p0)
    return out


class StepScaleSampler:
    """Snapshots an aggregator's ``/metrics`` on entry and in :meth:`stop`; use it as a context
    manager around the benchmark.

    After :meth:`stop`: :attr:`scales` (``{node: step-time scale}``, :func:`step_scales`; ``{}``
    if a snapshot failed) and, with ``tbt_slo_ms`` (τ, ms), :attr:`engine_tbt_violation_rate` (the
    share of decode steps above τ, :func:`violation_rate`; None if a snapshot failed or has no
    bucket at τ). A restart of the aggregator in between resets its counters; when a node's count
    is then below its first snapshot's, both are unknown (``{}`` / None). A restarted aggregator
    whose counts have already passed the first snapshot's is not detected (its figures then cover
    only the steps since the restart, less the first snapshot's).
    """

    def __init__(self, metrics_url: str, tbt_slo_ms: float | None = None) -> None:
        self.url, self.tbt_slo_ms = metrics_url, tbt_slo_ms
        self._before: str | None = None
        self.scales: dict[str, float] = {}
        self.engine_tbt_violation_rate: float | None = None

    def _scrape(self) -> str | None:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                return r.read().decode()
        except OSError:
            return None

    def __enter__(self) -> "StepScaleSampler":
        self._before = self._scrape()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> dict[str, float]:
        """Take the second snapshot (once); returns :attr:`scales`."""
        before, self._before = self._before, None
        after = None if before is None else self._scrape()
        if before is None or after is None:
            return self.scales
        try:
            t0, t1 = parse_step_times(before), parse_step_times(after)
            if any(c < t0.get(n, (0.0,))[0] for n, (c, _, _) in t1.items()) or set(t0) - set(t1):
                return self.scales  # the aggregator restarted: its counters began again
            self.scales = step_scales(t0, t1)
            if self.tbt_slo_ms is not None:
                self.engine_tbt_violation_rate = violation_rate(parse_decode_steps(before, self.tbt_slo_ms),
                                                                parse_decode_steps(after, self.tbt_slo_ms))
        except ValueError:
            pass
        return self.scales


__all__ = ["StepScaleSampler", "parse_decode_steps", "parse_step_times", "step_scales", "violation_rate",
           "HISTOGRAM", "STEP_TIME", "STEPS"]
