"""`kairos decide`: the issue's example and malformed snapshots (exit 2, message names the field,
nothing on stdout)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kairos.cli.main import main

EXAMPLE = (Path(__file__).resolve().parents[2] / "examples" / "snapshot.json").read_text()


def run(args, stdin=None):
    return CliRunner().invoke(main, args, input=stdin)


def test_decides_the_readme_example():
    res = run(["decide", "-"], EXAMPLE)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    for key in ("request_id", "policy", "decision", "node", "chunk_schedule", "predicted_step_ms",
                "ttft_prefill_est_ms", "ttft_decode_est_ms", "reason"):
        assert key in out
    assert out["request_id"] == "r1" and out["policy"] == "kairos"
    assert out["decision"] in ("deflect", "keep")
    assert set(out["ttft_decode_est_ms"]) == {"decode-0"}


def test_options_change_the_decision():
    deflect = json.loads(run(["decide", "-"], EXAMPLE).stdout)
    keep = json.loads(run(["decide", "-", "--policy", "pd"], EXAMPLE).stdout)
    tight = json.loads(run(["decide", "-", "--tbt-slo-ms", "40"], EXAMPLE).stdout)
    assert deflect["decision"] == "deflect" and keep["decision"] == "keep"
    assert tight["decision"] == "keep" and tight["ttft_decode_est_ms"]["decode-0"] is None


def test_reads_a_file_and_profile_path(tmp_path):
    snap = tmp_path / "s.json"
    snap.write_text(EXAMPLE)
    from kairos.core.model.latency import load_profile

    prof = tmp_path / "p.json"
    load_profile().save(prof)
    res = run(["decide", str(snap), "--profile", str(prof), "--alpha", "1.0", "--beta", "0.9"])
    assert res.exit_code == 0 and json.loads(res.stdout)["model_version"] == "a100-dsv2lite@2026.11.1"


def _mutated(fn):
    doc = json.loads(EXAMPLE)
    fn(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("doc,field", [
    (_mutated(lambda d: d["request"].pop("prompt_tokens")), "prompt_tokens"),
    (_mutated(lambda d: d["decode_nodes"][0].update(kv_tokens=-5)), "$.decode_nodes[0].kv_tokens"),
    (_mutated(lambda d: d["decode_nodes"][0].update(batch_size="16")), "$.decode_nodes[0].batch_size"),
    (_mutated(lambda d: d["prefill_nodes"][0].update(queue_prompt_tokens=[1, -2])),
     "$.prefill_nodes[0].queue_prompt_tokens[1]"),
    (_mutated(lambda d: d.update(decode_nodes=[])), "$.decode_nodes"),
    (_mutated(lambda d: d.update(prefill_nodes=[])), "$.prefill_nodes"),
    (_mutated(lambda d: d.pop("request")), "request"),
    (_mutated(lambda d: d["decode_nodes"].append(dict(d["decode_nodes"][0]))), "$.decode_nodes[1].id"),
    ("{not json", "not valid JSON"),
    (_mutated(lambda d: d["request"].update(prompt_tokens=10 ** 310)), "$.request.prompt_tokens"),
    (_mutated(lambda d: d["decode_nodes"][0].update(batch_size=2 ** 63)), "$.decode_nodes[0].batch_size"),
])
def test_malformed_snapshot_exits_2_naming_the_field(doc, field):
    res = run(["decide", "-"], doc)
    assert res.exit_code == 2
    assert res.stdout == ""
    assert field in res.stderr


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["decode_nodes"][0].update(deflection_in_flght=True), "deflection_in_flght"),  # the typo of issue 11
    (lambda d: d.update(note="hi"), "note"),
    (lambda d: d["request"].update(prompt_token=5), "prompt_token"),
    (lambda d: d["prefill_nodes"][0].update(queue=[1]), "queue"),
])
def test_unknown_fields_exit_2_naming_the_field(mutate, field):
    res = run(["decide", "-"], _mutated(mutate))
    assert res.exit_code == 2 and res.stdout == ""
    assert f"unknown field `{field}`" in res.stderr


@pytest.mark.parametrize("args,hint", [
    (["--policy", "magic"], "unknown policy"), (["--profile", "nope"], "no profile"), (["--alpha", "0.5"], "--alpha:"),
    (["--tbt-slo-ms", "inf"], "finite"), (["--beta", "nan"], "finite"), (["--tbt-slo-ms", "0"], "--tbt-slo-ms:"),
])
def test_bad_options_exit_2(args, hint):
    res = run(["decide", "-", *args], EXAMPLE)
    assert res.exit_code == 2 and res.stdout == "" and hint in res.stderr
