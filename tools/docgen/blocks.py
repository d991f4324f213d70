"""The generated blocks of README.md and docs/*.md: the one place that registers them.

A generated block is the text between ``<!-- kairos:generated NAME -->`` and
``<!-- /kairos:generated -->`` in a markdown file; ``python -m tools.docgen`` rewrites it from its
renderer and ``--check`` fails when it differs, or when a block is not in the files this registry
names (``tests/unit/test_docgen.py``). A renderer takes the result loader (:data:`Load`: name →
the committed ``bench/results/<name>.jsonl``) and returns markdown; it only formats (every figure is
a field of committed data or arithmetic on it) with :mod:`tools.docgen.fmt`.

To add a block: write its renderer in the module of its topic (``*_blocks.py``, or a module of its
own), add ONE line to :data:`BLOCKS` naming the markdown file(s) that hold it, put the markers in
those files, run ``python -m tools.docgen``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from tools.docgen import (api_blocks, bus_blocks, cli_blocks, fleet_blocks, ops_blocks, plan_blocks, profile_blocks,
                          scaling_blocks, sim_blocks, summary_blocks, vllm_blocks)
from tools.docgen.error_codes import error_codes
from tools.docgen.policy_table import policy_table
from tools.docgen.results import Load

Renderer = Callable[[Load], str]


class Block:
    """A generated block: its ``render`` function and the markdown ``files`` (relative to the repo
    root, each one of :data:`tools.docgen.docgen.DOC_FILES`) that hold it."""

    __slots__ = ("render", "files")

    def __init__(self, render: Renderer, *files: str) -> None:
        if not files:
            raise ValueError("a block is held by at least one markdown file")
        self.render = render
        self.files = files


def _profile_fit(name: str) -> Renderer:
    """Block ``profile-fit.<name>``: the fit the artifact ``kairos/core/data/profiles/<name>.json`` records."""
    return partial(profile_blocks.profile_fit, name=name)


#: block name → renderer and the file(s) holding it: THE registration point (one line per block)
BLOCKS: dict[str, Block] = {
    # README.md
    "demo-default": Block(cli_blocks.demo_default, "README.md"),
    "results-summary": Block(summary_blocks.results_summary, "README.md"),
    # docs/results.md
    "sim-bursty": Block(sim_blocks.sim_bursty, "docs/results.md"),
    "sim-speed": Block(sim_blocks.sim_speed, "docs/results.md"),
    "sim-mooncake": Block(sim_blocks.sim_mooncake, "docs/results.md"),
    "prefix-index": Block(sim_blocks.prefix_index, "docs/results.md"),
    "decision-cost": Block(sim_blocks.decision_cost, "docs/results.md"),
    "snapshot-cost": Block(scaling_blocks.snapshot_cost, "docs/results.md"),
    "control-plane": Block(bus_blocks.control_plane, "docs/results.md"),
    "control-plane-traced": Block(partial(bus_blocks.control_plane, name="control-plane-traced"), "docs/results.md"),
    "control-plane-compare": Block(bus_blocks.control_plane_compare, "docs/results.md"),
    "bus-floor": Block(bus_blocks.bus_floor, "docs/results.md"),
    "bus-routes": Block(bus_blocks.bus_routes, "docs/results.md", "docs/bus.md"),
    "fleet": Block(fleet_blocks.fleet, "docs/results.md", "README.md"),
    "request-path": Block(fleet_blocks.request_path, "docs/results.md", "docs/bus.md", "README.md"),
    "view-costs": Block(scaling_blocks.view_costs, "docs/results.md"),
    "fidelity": Block(cli_blocks.fidelity, "docs/results.md"),
    "vllm-demo": Block(vllm_blocks.vllm_demo, "docs/results.md"),
    "vllm-ab": Block(vllm_blocks.vllm_ab, "docs/results.md"),
    "vllm-headroom": Block(vllm_blocks.vllm_headroom, "docs/results.md"),
    # docs/api.md
    "validation-cost": Block(api_blocks.validation_cost, "docs/api.md"),
    # docs/cli.md
    "decide-example": Block(cli_blocks.decide_example, "docs/cli.md"),
    "plan-example": Block(plan_blocks.plan_example, "docs/plan.md", "docs/cli.md"),
    "plan-replay": Block(plan_blocks.plan_replay, "docs/plan.md"),
    "plan-scaling": Block(plan_blocks.plan_scaling, "docs/plan.md"),
    "plan-live": Block(plan_blocks.plan_live, "docs/plan.md"),
    "plan-saving": Block(plan_blocks.plan_saving, "README.md"),
    "bench-example": Block(cli_blocks.bench_example, "docs/cli.md"),
    # docs/reliability.md, docs/bus.md, docs/security.md, docs/deploy.md
    "nats-cluster-failover": Block(ops_blocks.nats_cluster_failover, "docs/reliability.md", "docs/bus.md"),
    "mutation": Block(ops_blocks.mutation, "docs/reliability.md"),
    "churn": Block(ops_blocks.churn, "docs/reliability.md", "README.md"),
    "slow-clients": Block(ops_blocks.slow_clients, "docs/security.md"),
    "compose-smoke": Block(ops_blocks.compose_smoke, "docs/deploy.md"),
    # docs/calibration.md
    "calibration-link": Block(sim_blocks.calibration_link, "docs/calibration.md"),
    "emulated-cpu-fit": Block(profile_blocks.emulated_cpu_fit, "docs/calibration.md"),
    "profile-fit.cpu-testbed-vllm": Block(_profile_fit("cpu-testbed-vllm"), "docs/calibration.md"),
    "profile-fit.cpu-tiny-vllm": Block(_profile_fit("cpu-tiny-vllm"), "docs/calibration.md"),
    # docs/policies.md, docs/errors.md, docs/vllm.md
    "model-error": Block(sim_blocks.model_error_table, "docs/policies.md"),
    "policy-table": Block(policy_table, "docs/policies.md"),
    "error-codes": Block(error_codes, "docs/errors.md"),
    "vllm-pd-rate": Block(vllm_blocks.vllm_pd_rate, "docs/vllm.md"),
    "vllm-step-times": Block(vllm_blocks.vllm_step_times, "docs/vllm.md"),
}

#: block name → renderer (a view of :data:`BLOCKS`; register blocks there, not here)
RENDERERS: dict[str, Renderer] = {name: block.render for name, block in BLOCKS.items()}
