"""Figures in README.md and docs/ are generated from committed result files (tools/docgen/docgen.py):
every generated block equals its rendering from bench/results/ (a hand edit or a stale block
fails), the converted sections hold no figure outside generated blocks, and the recorder writes
what the renderers read."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from tools.docgen import blocks as docblocks

from tools.docgen import docgen


def test_every_generated_block_equals_its_rendering_from_the_committed_results():
    assert docgen.stale_blocks() == []


def test_every_renderer_has_a_block_and_every_block_a_renderer():
    used = {m.group("name") for rel in docgen.DOC_FILES for m in docgen.BLOCK.finditer((docgen.ROOT / rel).read_text())}
    assert {n for n in used if n.partition(".")[0] not in docblocks.PARAM_RENDERERS} == set(docblocks.RENDERERS)


def test_a_fitted_profile_renders_from_its_own_metadata_and_a_calibration_is_refused():
    art = json.loads((docgen.ROOT / "kairos" / "core" / "data" / "profiles" / "emulated-cpu.json").read_text())
    text = " ".join(docgen.render_block("profile-fit.emulated-cpu").split())
    assert f"held-out MAPE {art['prefill']['mape_heldout']:.1f} % (prefill)" in text
    assert f"{art['metadata']['steps_recorded']} steps in {art['metadata']['duration_s']:.0f} s" in text
    with pytest.raises(docgen.DocgenError, match="records no fit"):
        docgen.render_block("profile-fit.a100-dsv2lite")
    with pytest.raises(docgen.DocgenError, match="no renderer"):
        docgen.render_block("no-such-block")


def test_converted_sections_hold_no_typed_figures():
    assert docgen.typed_figures() == []


def test_a_hand_edited_figure_in_a_block_is_caught(tmp_path):
    for rel in docgen.DOC_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(docgen.ROOT / rel, tmp_path / rel)
    readme = tmp_path / "README.md"
    text = readme.read_text()
    m = next(m for m in docgen.BLOCK.finditer(text) if m.group("name") == "sim-bursty")
    body = m.group("body")
    edited = body.replace("deflections", "deflections (hand-edited: 1 more)", 1)
    assert edited != body
    readme.write_text(text[:m.start("body")] + edited + text[m.end("body"):])
    assert docgen.stale_blocks(root=tmp_path) == ["README.md: sim-bursty"]
    # and rewriting restores the rendering
    readme.write_text(docgen.regenerate(readme.read_text()))
    assert docgen.stale_blocks(root=tmp_path) == []


def test_a_typed_figure_outside_a_block_is_caught(tmp_path):
    (tmp_path / "README.md").write_text(
        "## Results\n\nKairos cuts P95 TTFT to 5.6 s on 2P2D, see `kairos sim --rps 4`.\n"
        "<!-- kairos:generated sim-bursty -->\n9.4 s\n<!-- /kairos:generated -->\n\n## Next\n\n7 s\n")
    assert docgen.typed_figures(root=tmp_path) == ["README.md: ## Results: Kairos cuts  TTFT to 5.6 s on , see ."]


def test_the_scanner_keeps_names_and_drops_figures():
    assert docgen.figures_outside("P99 in §6, Table 4, Eq. 1–3, `sq:1`, {x} ms") == []
    assert docgen.figures_outside("offered 200 req/s") == ["offered 200 req/s"]


def test_record_writes_the_rows_and_provenance_the_renderers_read(tmp_path):
    rows = [{"cluster": "2P2D", "p50_us": 12.5}, {"cluster": "8P64D", "p50_us": 80.0}]
    code = "import json; [print(json.dumps(r)) for r in %r]; print('not a row')" % rows
    path = docgen.record("probe", [sys.executable, "-c", code], results_dir=tmp_path)
    r = docgen.load_result("probe", tmp_path)
    assert r.rows == rows
    assert r.meta["command"].endswith("print('not a row')")
    assert {"date", "machine", "loadavg_1m", "wall_s"} <= set(r.meta)
    assert r.one(cluster="8P64D")["p50_us"] == 80.0
    assert path == tmp_path / "probe.jsonl"


def test_record_refuses_a_failing_command_and_writes_nothing(tmp_path):
    with pytest.raises(docgen.DocgenError, match="exited with 3"):
        docgen.record("bad", [sys.executable, "-c", "print('{\"a\": 1}'); raise SystemExit(3)"], results_dir=tmp_path)
    assert not (tmp_path / "bad.jsonl").exists()


def test_a_result_file_without_meta_is_read_and_a_missing_one_named(tmp_path):
    (tmp_path / "plain.jsonl").write_text(json.dumps({"dispatchers": 1, "offered_rps": 100}) + "\n")
    r = docgen.load_result("plain", tmp_path)
    assert r.meta == {} and r.rows == [{"dispatchers": 1, "offered_rps": 100}]
    with pytest.raises(docgen.DocgenError, match="record it: python -m tools.docgen record absent"):
        docgen.load_result("absent", tmp_path)


def test_record_rows_from_a_file_the_command_writes_and_not_from_a_stale_one(tmp_path):
    out = tmp_path / "rows.json"
    code = f"import json; open({str(out)!r}, 'w').write(json.dumps([{{'policy': 'pd', 'rps': 4}}]))"
    docgen.record("sim", [sys.executable, "-c", code], rows_from=str(out), results_dir=tmp_path)
    assert docgen.load_result("sim", tmp_path).rows == [{"policy": "pd", "rps": 4}]
    os.utime(out, (out.stat().st_atime - 60, out.stat().st_mtime - 60))  # left over from an earlier run
    with pytest.raises(docgen.DocgenError, match="not written by this run"):
        docgen.record("stale", [sys.executable, "-c", "pass"], rows_from=str(out), results_dir=tmp_path)
