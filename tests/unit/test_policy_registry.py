"""The policy table (kairos/core/policy/registry.py): a policy registered with one entry behaves the
same live (the dispatcher's routing path, configured as ``kairos up`` configures it) and in
``kairos sim``, and the CLI takes it; every registered spec's traits are what the code does."""

from __future__ import annotations

import inspect
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from kairos.cli.main import main
from kairos.cli.up_plan import UpOptions, plan
from kairos.contracts.wire import ClusterView, InferenceRequest, NodeView, Reservation
from kairos.core.cluster.routing import build_snapshot, decide_within_slots, deflection_slots
from kairos.core.cluster.snapshot import ClusterSnapshot, DecodeNodeView, PrefillNodeView, RequestView
from kairos.core.model.correction import StepCorrection
from kairos.core.model.latency import DEFAULT_PROFILE, load_profile
from kairos.core.policy import DEFAULT_PARAMS, POLICIES, Decision, PolicyError, parse_policy
from kairos.core.policy.common import best_prefill, least_loaded_decode
from kairos.core.policy.estimates import fixed_chunk_steps
from kairos.core.policy.registry import PolicyArg, PolicySpec, node_guard_policies, policy_help
from kairos.core.workload.workloads import WorkloadRequest
from kairos.runtime.envconfig import ConfigError, from_env
from kairos.services.dispatcher.config import DispatcherConfig
from kairos.services.node_agent.config import AgentConfig
from kairos.sim.config import SimConfig
from kairos.sim.simulator import Simulator
from kairos.sim.view import DispatcherView

MODEL = load_profile(DEFAULT_PROFILE)
ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- a policy added at test time

def decide_toy(limit: int):
    """The toy policy's module: deflect prompts shorter than ``limit`` tokens onto the decode node
    showing the fewest deflections in flight (a full node shows none: rule 3 must catch it)."""

    def decide(spec: str, snap: ClusterSnapshot, model, params) -> Decision:
        pf, ttft_pf, kv_ms = best_prefill(snap, model, params)
        common = dict(request_id=snap.request.id, policy=spec, ttft_prefill_est_ms=ttft_pf, kv_transfer_est_ms=kv_ms,
                      model_version=model.artifact_version)
        if snap.request.prompt_tokens >= limit:
            return Decision(decision="keep", node=pf, decode_node=least_loaded_decode(snap), reason="toy_long",
                            **common)
        dn = min(snap.decode_nodes, key=lambda d: (len(d.in_flight), d.kv_tokens))
        chis, steps = fixed_chunk_steps(model, dn.batch_size, dn.kv_tokens, snap.request.prompt_tokens,
                                        params.static_chunk_tokens)
        return Decision(decision="deflect", node=dn.id, decode_node=dn.id, chunk_schedule=chis,
                        predicted_step_ms=steps, reason="toy_short", **common)

    return decide


TOY = PolicySpec("toy", decide_toy, "deflect short prompts (a test's policy)", "tests/unit/test_policy_registry.py",
                 args=(PolicyArg("ℓ", "prompt tokens", example=1024),), params=("static_chunk_tokens",),
                 deflection_slots=2, node_guard=True)


@pytest.fixture
def toy():
    """The toy policy registered for one test (one entry in the table), removed after it."""
    assert TOY.name not in POLICIES
    POLICIES[TOY.name] = TOY
    yield TOY
    del POLICIES[TOY.name]


def live_config(spec: str, tmp_path: Path) -> tuple[DispatcherConfig, AgentConfig]:
    """The configuration ``kairos up --policy SPEC`` gives its dispatcher and its first decode agent
    (read back from the children's ``KAIROS_*`` environment, as the services read it)."""
    children = plan(UpOptions(policy=spec, prefill=1, decode=2, dispatchers=1), "nats://127.0.0.1:4222", tmp_path)
    env = {c.name: c.env for c in children}
    return from_env(DispatcherConfig, env["dispatcher-0"]), from_env(AgentConfig, env["decode-0"])


def workload() -> list[WorkloadRequest]:
    """Bursts of short and long prompts, close enough that deflections overlap on the decode nodes."""
    prompts = [300, 700, 2500, 500, 900, 200, 4000, 600, 350, 800, 1500, 450]
    return [WorkloadRequest(id=f"r{i:03d}", arrival_s=0.02 * i + (0.5 if i >= 24 else 0.0),
                            prompt_tokens=prompts[i % len(prompts)], output_tokens=20 + (i * 7) % 60)
            for i in range(48)]


def view_of(snap: ClusterSnapshot, now_ms: float) -> ClusterView:
    """The aggregator's view of the node states the simulator's dispatcher saw in ``snap``."""
    nodes = [NodeView(node=p.id, role="prefill", stale=False, age_ms=0.0, queue_prompt_tokens=p.queue_prompt_tokens,
                      kv_backlog_ms=p.kv_backlog_ms, correction=StepCorrection(bias=p.step_bias))
             for p in snap.prefill_nodes]
    nodes += [NodeView(node=d.id, role="decode", stale=False, age_ms=0.0, batch_size=d.batch_size,
                       kv_tokens=d.kv_tokens, waiting=d.waiting,
                       correction=StepCorrection(bias=d.step_bias, safety=d.step_safety))
              for d in snap.decode_nodes]
    return ClusterView(seq=1, built_unix_ms=now_ms, period_ms=100.0, stale_after_ms=300.0, nodes=nodes)


def test_a_new_entry_routes_the_same_live_and_in_the_simulator(toy, tmp_path, monkeypatch):
    """Every arrival of a ``kairos sim`` run of the toy policy, routed again by the dispatcher's pure
    path (:func:`build_snapshot` from the same node states and reservations, then
    :func:`decide_within_slots`) with the configuration ``kairos up`` gives the dispatcher: the same
    snapshot, the same decision. The table's deflection slots (2) reach both sides."""
    seen: list[tuple] = []  # (arrival, reservations before the decision, its snapshot, the decision)
    snapshot_of, decide_of = DispatcherView._snapshot, DispatcherView.decide

    def spy_snapshot(self, w, now, links):
        snap = snapshot_of(self, w, now, links)
        seen.append((w, {i: dict(res) for i, res in self.reserved.items()}, snap))
        return snap

    def spy_decide(self, w, now, links):
        d = decide_of(self, w, now, links)
        seen[-1] = (*seen[-1], d, now)
        return d

    monkeypatch.setattr(DispatcherView, "_snapshot", spy_snapshot)
    monkeypatch.setattr(DispatcherView, "decide", spy_decide)
    cfg, agent = live_config(TOY.example, tmp_path)
    assert cfg.max_deflections_per_node == agent.max_deflections == TOY.deflection_slots
    policy = parse_policy(cfg.policy, live=True)
    params = cfg.params(MODEL.engine.max_num_batched_tokens)  # as the dispatcher builds them
    sim = Simulator(SimConfig(n_prefill=1, n_decode=2, heartbeat_ms=0.0), MODEL, parse_policy(TOY.example), params)
    sim.run(workload())

    assert len(seen) == len(workload())
    for w, reserved, sim_snap, sim_decision, now in seen:
        held = {f"{i}.{rid}": Reservation(request_id=rid, decode_node=sim.view.nodes.decode_ids[i], dispatcher_id="d",
                                          prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens,
                                          created_unix_ms=float(k), expires_unix_ms=1e15)
                for i, res in reserved.items() for k, (rid, r) in enumerate(res.items())}
        req = InferenceRequest(request_id=w.id, model="m", prompt_tokens=w.prompt_tokens, max_tokens=w.output_tokens,
                               created_unix_ms=now, deadline_unix_ms=now + 60_000.0)
        snap = build_snapshot(req, view_of(sim_snap, now), held, {}, now, cfg.max_deflections_per_node)
        assert msgspec.structs.replace(snap, state_age_ms=None) == sim_snap, w.id
        live = decide_within_slots(policy, snap, MODEL, params, held, set(), cfg.max_deflections_per_node)
        assert live == sim_decision, w.id
    reasons = [d.reason for *_, d, _ in seen]
    assert "keep_reservation_conflict" in reasons and "toy_short" in reasons  # rule 3 met, deflections made
    assert any(len(dn.in_flight) == 1 for _, _, s, _, _ in seen for dn in s.decode_nodes)  # a second slot was used


def test_the_cli_takes_a_new_entry_with_its_traits(toy, tmp_path, monkeypatch):
    import kairos.cli.up
    import kairos.sim.experiments

    r = CliRunner().invoke(main, ["decide", "--policy", "toy:600", str(ROOT / "examples" / "snapshot.json")])
    assert r.exit_code == 0 and '"policy": "toy:600"' in r.output, r.output
    guards: dict[str, bool] = {}
    run_one = kairos.sim.experiments.run_one

    def spy(wl, pol, model, params, cfg, **kw):
        guards[pol.spec] = cfg.tbt_guard
        return run_one(wl, pol, model, params, cfg, **kw)

    monkeypatch.setattr(kairos.sim.experiments, "run_one", spy)
    r = CliRunner().invoke(main, ["sim", "--policy", "pd,toy:600", "--duration", "5", "--rps", "2"])
    assert r.exit_code == 0 and "toy:600" in r.output, r.output
    assert guards == {"pd": False, "toy:600": True}  # the node-side guard: the table's trait, as kairos up
    _, agent = live_config("toy:600", tmp_path)
    assert agent.tbt_guard_ms == DEFAULT_PARAMS.beta * DEFAULT_PARAMS.tbt_slo_ms
    started: list[UpOptions] = []
    monkeypatch.setattr(kairos.cli.up, "run_up", lambda opts: started.append(opts) or 0)
    r = CliRunner().invoke(main, ["up", "--policy", "toy:600"])
    assert r.exit_code == 0 and started[-1].policy == "toy:600", r.output
    r = CliRunner().invoke(main, ["up", "--policy", "toy"])  # its argument is required
    assert r.exit_code == 2 and "needs exactly one argument (ℓ = prompt tokens)" in r.output, r.output
    assert "toy:ℓ" in policy_help(live=True) and "toy" in node_guard_policies()


# ---------------------------------------------------------------- every registered spec

SPECS = list(POLICIES.values())
ids = [s.name for s in SPECS]


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_live_or_simulator_only_is_what_the_dispatcher_and_kairos_up_accept(spec, tmp_path):
    parse_policy(spec.example)  # kairos sim runs every policy
    if spec.live:
        assert parse_policy(spec.example, live=True).traits is spec
        assert DispatcherConfig(policy=spec.example).policy == spec.example
        assert spec.name in policy_help(live=True).split("(")[0]
    else:
        with pytest.raises(PolicyError, match="simulator baseline"):
            parse_policy(spec.example, live=True)
        with pytest.raises(ConfigError, match="simulator baseline"):
            DispatcherConfig(policy=spec.example)
        r = CliRunner().invoke(main, ["up", "--policy", spec.example])
        assert r.exit_code == 2 and f"kairos sim --policy {spec.example}" in r.output, r.output


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_deflection_slots_and_node_guard_are_what_kairos_up_and_the_simulator_use(spec, tmp_path):
    sim = Simulator(SimConfig(), MODEL, parse_policy(spec.example), DEFAULT_PARAMS)
    assert sim.view.slots == deflection_slots(spec.name) == spec.deflection_slots
    if not spec.live:
        return
    cfg, agent = live_config(spec.example, tmp_path)
    assert cfg.max_deflections_per_node == agent.max_deflections == spec.deflection_slots
    guard = DEFAULT_PARAMS.beta * DEFAULT_PARAMS.tbt_slo_ms
    assert agent.tbt_guard_ms == (guard if spec.node_guard else None)


def cached_snapshot(hit: int) -> ClusterSnapshot:
    """1,500 prompt tokens, ``hit`` of them cached on prefill-0 and decode-0; busy prefill nodes."""
    return ClusterSnapshot(
        request=RequestView(id="r", prompt_tokens=1500, output_tokens=50),
        prefill_nodes=[PrefillNodeView(id="prefill-0", queue_prompt_tokens=[3000], cached_prefix_tokens=hit),
                       PrefillNodeView(id="prefill-1", queue_prompt_tokens=[3000, 2000])],
        decode_nodes=[DecodeNodeView(id="decode-0", batch_size=8, kv_tokens=8000, cached_prefix_tokens=hit),
                      DecodeNodeView(id="decode-1", batch_size=4, kv_tokens=4000)])


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_prefix_aware_policies_and_only_they_read_the_cached_prefixes(spec):
    pol = parse_policy(spec.example)
    assert pol.uses_prefix_caches(DEFAULT_PARAMS) is spec.needs_prefix_index
    cold, warm = (pol.decide(cached_snapshot(hit), MODEL, DEFAULT_PARAMS) for hit in (0, 1000))
    assert (cold != warm) is spec.needs_prefix_index, (cold, warm)


@pytest.mark.parametrize("spec", SPECS, ids=ids)
def test_arguments_switches_and_parameters_are_the_specs(spec):
    pol = parse_policy(spec.example)
    assert pol.traits is spec and pol.spec == spec.example and "\n" not in spec.description
    applied = pol.params(DEFAULT_PARAMS)
    assert all(getattr(applied, k) == v for k, v in spec.overrides.items())
    assert spec.defaults() == {p: getattr(applied, p) for p in spec.params}
    # the table's argument defaults are the ones the rule's own factory declares
    factory = inspect.signature(spec.build).parameters.values()
    assert [a.default for a in spec.args if a.default is not None] == \
        [p.default for p in factory if p.default is not inspect.Parameter.empty]
    with pytest.raises(PolicyError, match="argument"):
        parse_policy(":".join([spec.example, *["1"] * (len(spec.args) + 1 - spec.example.count(":"))]))
