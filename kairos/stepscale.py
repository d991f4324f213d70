"""How much slower (or faster) the engines ran than their latency profile during a live run.

The state aggregator learns, per node, the ratio of each executed step's measured time to the
profile's prediction (``shared.correction``: ``bias`` = mean of actual ÷ predicted over a sliding
window) and exports it as the gauge ``kairos_aggregator_node_step_correction{node, factor="bias"}``.
:class:`StepScaleSampler` reads that gauge every ``period_s`` while a benchmark runs and keeps the
median per node: the step-time scale the demo reports beside its fidelity table, and the scale
with which it re-runs the simulator (``truth_scale`` / ``drift``) to show how much of a live ÷
simulated gap the engines' own step times explain.

It also reads the aggregator's histogram ``kairos_aggregator_decode_step_seconds`` (every engine step
that carried decodes) once when the benchmark starts and once when it ends: the share of those
steps above the TBT SLO τ in between is the live TBT violation rate as the simulator counts it
(Table 4: "% of decode steps"), beside the client's share of inter-token gaps above τ.
"""

from __future__ import annotations

import statistics
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

GAUGE = "kairos_aggregator_node_step_correction"
HISTOGRAM = "kairos_aggregator_decode_step_seconds"


def parse_bias(text: str) -> dict[str, float]:
    """``{node: bias}`` from a Prometheus exposition ``text``. Nodes without a bias are absent, and so
    are nodes at exactly 1: the estimator's identity, which it reports for a node with fewer steps
    in its window than it needs (``shared.correction.CorrectionEstimator`` ``min_samples``), not a
    measurement.

    Raises:
        ValueError: ``text`` is not the Prometheus text format.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != GAUGE:
            continue
        for sample in family.samples:
            if sample.labels.get("factor") == "bias" and sample.value > 0 and sample.value != 1.0:
                out[sample.labels["node"]] = float(sample.value)
    return out


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


class StepScaleSampler:
    """Polls an aggregator's ``/metrics`` URL in a daemon thread; :meth:`stop` returns the medians.

    Use as a context manager around the benchmark. A failed scrape is skipped (the aggregator may
    restart); no sample at all gives ``{}``. With ``tbt_slo_ms`` (τ, ms) it also snapshots the
    decode-step histogram on entry and in :meth:`stop`; :attr:`engine_tbt_violation_rate` is then
    the share of decode steps above τ in between (None if a snapshot failed, or if the aggregator
    restarted in between and its counters went back).
    """

    def __init__(self, metrics_url: str, period_s: float = 2.0, tbt_slo_ms: float | None = None) -> None:
        self.url, self.period_s, self.tbt_slo_ms = metrics_url, period_s, tbt_slo_ms
        self._steps_before: dict[str, tuple[float, float]] | None = None
        self.engine_tbt_violation_rate: float | None = None
        self.samples: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-scale-sampler", daemon=True)

    def _scrape(self) -> str | None:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as r:
                return r.read().decode()
        except OSError:
            return None

    def _decode_steps(self) -> dict[str, tuple[float, float]] | None:
        text = None if self.tbt_slo_ms is None else self._scrape()
        try:
            return None if text is None else parse_decode_steps(text, self.tbt_slo_ms)
        except ValueError:
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):  # the sampling period, not a synchronisation
            text = self._scrape()
            try:
                bias = {} if text is None else parse_bias(text)
            except ValueError:
                continue
            for node, b in bias.items():
                self.samples.setdefault(node, []).append(b)

    def __enter__(self) -> "StepScaleSampler":
        self._steps_before = self._decode_steps()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> dict[str, float]:
        """Stop polling; ``{node: median bias}`` over the samples taken."""
        if not self._stop.is_set():
            after = self._decode_steps()
            went_back = after is not None and self._steps_before is not None and any(
                c < self._steps_before.get(n, (0.0, 0.0))[0] for n, (c, _) in after.items())
            self.engine_tbt_violation_rate = None if went_back else violation_rate(self._steps_before, after)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        return self.medians()

    def medians(self) -> dict[str, float]:
        return {n: statistics.median(v) for n, v in sorted(self.samples.items()) if v}


__all__ = ["StepScaleSampler", "parse_bias", "parse_decode_steps", "violation_rate", "GAUGE", "HISTOGRAM"]
