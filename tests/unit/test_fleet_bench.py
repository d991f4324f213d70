"""bench/fleet.py's pure helpers against independent truths: a histogram quantile of uniform data is
the data's own quantile, counts above a bound are what was observed there, growth is last / first."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_fleet", ROOT / "bench" / "fleet.py")
F = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(F)


def cumulative(values: np.ndarray, bounds: list[float]) -> list[tuple[float, float]]:
    return [(b, float((values <= b).sum())) for b in bounds] + [(float("inf"), float(len(values)))]


def test_quantiles_of_uniform_data_match_numpy_within_a_bucket():
    values = np.linspace(0.001, 1.0, 1000)  # uniform: linear interpolation inside a bucket is exact
    buckets = cumulative(values, [i / 10 for i in range(1, 11)])
    for q in (0.1, 0.5, 0.9, 0.99):
        assert F.histogram_quantile(q, buckets) == pytest.approx(np.quantile(values, q), abs=2e-3)


def test_a_quantile_in_the_inf_bucket_is_the_highest_finite_bound_and_empty_is_none():
    assert F.histogram_quantile(0.99, [(0.1, 1.0), (0.2, 2.0), (float("inf"), 100.0)]) == 0.2
    assert F.histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_count_above_counts_the_observations_past_the_bound():
    values = np.array([0.05, 0.15, 0.25, 0.35, 0.45, 0.5, 0.9])
    buckets = cumulative(values, [0.1, 0.3, 0.5, 1.0])
    assert F.count_above(0.3, buckets) == (values > 0.3).sum()
    assert F.count_above(0.5, buckets) == (values > 0.5).sum()


def test_growth_is_last_over_first_and_none_without_a_base():
    assert F.growth(2.0, 64.0) == 32.0
    assert F.growth(0.0, 5.0) is None and F.growth(None, 1.0) is None


def test_cpu_split_puts_the_fleet_and_the_client_in_the_harness_and_the_rest_in_the_control_plane():
    cpu = {"client": 20.0, "fleet": 60.5, "nats": 35.0, "aggregator": 17.5, "dispatcher": 30.0, "ingress": 28.0}
    assert F.cpu_split(cpu) == {"harness": 80.5, "control_plane": 110.5}
    assert F.cpu_split({"fleet": None, "nats": 1.0}) == {"harness": 0.0, "control_plane": 1.0}


def test_cpu_per_node_second_is_the_cores_share_spread_over_the_nodes():
    # 50 % of a core = 500 ms of CPU per second; over 250 nodes, 2 ms per node and second
    assert F.per_node_second({"nats": 50.0, "fleet": None}, 250) == {"nats": 2.0, "fleet": None}


def test_no_floor_is_measured_for_a_zero_duration():
    assert F.bus_floor(100.0, 0.0) is None


def test_sizes_parse_and_bad_ones_are_refused_with_the_form_expected():
    import argparse

    assert F.parse_sizes("2x2, 8X64,32x256") == [(2, 2), (8, 64), (32, 256)]
    for bad in ("2x3x4", "abc", "0x2", "2x0", "2x", "-1x2", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a size PxD"):
            F.parse_sizes(bad)
