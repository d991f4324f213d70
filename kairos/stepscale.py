"""How much slower (or faster) the engines ran than their latency profile during a live run.

The state aggregator learns, per node, the ratio of each executed step's measured time to the
profile's prediction (``shared.correction``: ``bias`` = mean of actual ÷ predicted over a sliding
window) and exports it as the gauge ``kairos_aggregator_node_step_correction{node, factor="bias"}``.
:class:`StepScaleSampler` reads that gauge every ``period_s`` while a benchmark runs and keeps the
median per node: the step-time scale the demo reports beside its fidelity table, and the scale
with which it re-runs the simulator (``truth_scale`` / ``drift``) to show how much of a live ÷
simulated gap the engines' own step times explain.
"""

from __future__ import annotations

import statistics
import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

GAUGE = "kairos_aggregator_node_step_correction"


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


class StepScaleSampler:
    """Polls an aggregator's ``/metrics`` URL in a daemon thread; :meth:`stop` returns the medians.

    Use as a context manager around the benchmark. A failed scrape is skipped (the aggregator may
    restart); no sample at all gives ``{}``.
    """

    def __init__(self, metrics_url: str, period_s: float = 2.0) -> None:
        self.url, self.period_s = metrics_url, period_s
        self.samples: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-scale-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):  # the sampling period, not a synchronisation
            try:
                with urllib.request.urlopen(self.url, timeout=2) as r:
                    bias = parse_bias(r.read().decode())
            except (OSError, ValueError):
                continue
            for node, b in bias.items():
                self.samples.setdefault(node, []).append(b)

    def __enter__(self) -> "StepScaleSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> dict[str, float]:
        """Stop polling; ``{node: median bias}`` over the samples taken."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        return self.medians()

    def medians(self) -> dict[str, float]:
        return {n: statistics.median(v) for n, v in sorted(self.samples.items()) if v}


__all__ = ["StepScaleSampler", "parse_bias", "GAUGE"]
