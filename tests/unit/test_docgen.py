"""Figures in README.md and docs/ are generated from committed result files (tools/docgen/docgen.py):
every generated block equals its rendering from bench/results/ (a hand edit or a stale block
fails) and sits in the files the registry (tools/docgen/blocks.py) names, the converted sections
hold no figure outside generated blocks, the recorder writes what the renderers read, and the
blocks and the reproduction report share one set of formatters (tools/docgen/fmt.py)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys

import pytest

from tools.docgen import blocks as docblocks
from tools.docgen import docgen, fmt, profile_blocks


def test_every_generated_block_equals_its_rendering_from_the_committed_results():
    assert docgen.stale_blocks() == []


def test_every_block_is_in_the_files_the_registry_names_and_only_there():
    assert docgen.misplaced_blocks() == []
    used = {m.group("name") for rel in docgen.DOC_FILES for m in docgen.BLOCK.finditer((docgen.ROOT / rel).read_text())}
    assert used == set(docblocks.BLOCKS) == set(docblocks.RENDERERS)


def _copy_docs(tmp_path):
    for rel in docgen.DOC_FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(docgen.ROOT / rel, tmp_path / rel)


def test_a_block_moved_out_of_its_registered_file_or_unregistered_is_named(tmp_path):
    _copy_docs(tmp_path)
    name = "decision-cost"
    home = docblocks.BLOCKS[name].files[0]
    text = (tmp_path / home).read_text()
    m = next(m for m in docgen.BLOCK.finditer(text) if m.group("name") == name)
    (tmp_path / home).write_text(text[:m.start()] + text[m.end():])
    other = next(rel for rel in docgen.DOC_FILES if rel not in docblocks.BLOCKS[name].files)
    (tmp_path / other).write_text((tmp_path / other).read_text() + "\n" + m.group(0) + "\n"
                                  + "<!-- kairos:generated no-such-block -->\nx\n<!-- /kairos:generated -->\n")
    assert sorted(docgen.misplaced_blocks(root=tmp_path)) == sorted([
        f"{other}: {name}: not registered for this file in tools/docgen/blocks.py BLOCKS",
        f"{other}: no-such-block: not registered for this file in tools/docgen/blocks.py BLOCKS",
        f"{home}: {name}: registered here, but the file holds no such block"])


def test_a_fitted_profile_renders_from_its_own_metadata_and_a_calibration_is_refused():
    art = json.loads((docgen.ROOT / "kairos" / "core" / "data" / "profiles" / "emulated-cpu.json").read_text())
    text = " ".join(docgen.render_block("profile-fit.cpu-testbed-vllm").split())
    assert "held-out MAPE" in text and "cpu-testbed-vllm" in text
    text = " ".join(docblocks.BLOCKS["emulated-cpu-fit"].render(lambda n: None).split())
    assert f"held-out MAPE of {art['prefill']['mape_heldout']:.2f} % (prefill)" in text
    text = " ".join(profile_blocks.profile_fit(lambda n: None, "emulated-cpu").split())
    assert f"held-out MAPE {art['prefill']['mape_heldout']:.1f} % (prefill)" in text
    assert f"{art['metadata']['steps_recorded']} steps in {art['metadata']['duration_s']:.0f} s" in text
    with pytest.raises(docgen.DocgenError, match="records no fit"):
        profile_blocks.profile_fit(lambda n: None, "a100-dsv2lite")
    with pytest.raises(docgen.DocgenError, match="no renderer"):
        docgen.render_block("no-such-block")


def test_converted_sections_hold_no_typed_figures():
    assert docgen.typed_figures() == []


def test_a_hand_edited_figure_in_a_block_is_caught(tmp_path):
    _copy_docs(tmp_path)
    rel = docblocks.BLOCKS["sim-bursty"].files[0]
    doc = tmp_path / rel
    text = doc.read_text()
    m = next(m for m in docgen.BLOCK.finditer(text) if m.group("name") == "sim-bursty")
    body = m.group("body")
    edited = body.replace("deflections", "deflections (hand-edited: 1 more)", 1)
    assert edited != body
    doc.write_text(text[:m.start("body")] + edited + text[m.end("body"):])
    assert docgen.stale_blocks(root=tmp_path) == [f"{rel}: sim-bursty"]
    # and rewriting restores the rendering
    doc.write_text(docgen.regenerate(doc.read_text()))
    assert docgen.stale_blocks(root=tmp_path) == []


def test_a_typed_figure_outside_a_block_is_caught(tmp_path):
    (tmp_path / "README.md").write_text(
        "## Results\n\nKairos cuts P95 TTFT to 5.6 s on 2P2D, see `kairos sim --rps 4`.\n"
        "<!-- kairos:generated sim-bursty -->\n9.4 s\n<!-- /kairos:generated -->\n\n## Next\n\n7 s\n")
    readme = tuple(x for x in docgen.FIGURE_FREE_SECTIONS if x[0] == "README.md")
    assert docgen.typed_figures(root=tmp_path, sections=readme) == [
        "README.md: ## Results: Kairos cuts  TTFT to 5.6 s on , see ."]


def test_every_figure_free_section_exists_and_results_md_is_one():
    files = {rel for rel, _, _ in docgen.FIGURE_FREE_SECTIONS}
    assert {"README.md", "docs/results.md"} <= files
    for rel, heading, _ in docgen.FIGURE_FREE_SECTIONS:
        assert docgen.section((docgen.ROOT / rel).read_text(), heading).strip(), f"{rel}: {heading} is empty"


def test_the_scanner_keeps_names_and_drops_figures():
    assert docgen.figures_outside("P99 in §6, Table 4, Eq. 1–3, `sq:1`, {x} ms") == []
    assert docgen.figures_outside("offered 200 req/s") == ["offered 200 req/s"]
    assert docgen.figures_outside("see [Eq. 1–6](policies.md#cache-aware-eq-16)") == []
    assert docgen.figures_outside("[2 ms](results.md#control)") == ["[2 ms"]


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


def test_one_set_of_formatters():
    """The blocks and the reproduction report format with tools/docgen/fmt.py: no other module of
    tools/docgen defines a function of the same name (a second copy)."""
    names = {n for n in vars(fmt) if callable(getattr(fmt, n)) and getattr(getattr(fmt, n), "__module__", "") == fmt.__name__}
    assert {"num", "pct", "ms", "seconds", "in_seconds", "span", "num_range", "ratio"} <= names
    for path in (docgen.ROOT / "tools" / "docgen").glob("*.py"):
        if path.name == "fmt.py":
            continue
        defined = {n.name.lstrip("_") for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        assert not defined & names, f"{path.name} defines its own {sorted(defined & names)}: use tools.docgen.fmt"


@pytest.mark.parametrize("call, text", [
    (lambda: fmt.num(1234.5, 1), "1,234.5"), (lambda: fmt.num(None), "–"), (lambda: fmt.sig(0.1734), "0.17"),
    (lambda: fmt.sig(1134), "1,134"), (lambda: fmt.us(460), "460 µs"), (lambda: fmt.us(4321), "4.3 ms"),
    (lambda: fmt.ms(9.44), "9.4 ms"), (lambda: fmt.ms(127.4), "127 ms"), (lambda: fmt.seconds(9412.0), "9.4 s"),
    (lambda: fmt.in_seconds(5160.0), "5.16"), (lambda: fmt.in_seconds(None), "–"), (lambda: fmt.pct(0.684), "68 %"),
    (lambda: fmt.pct(0.00172, 2), "0.17 %"), (lambda: fmt.ratio(3.0, 4.0), "0.75"), (lambda: fmt.ratio(1.0, 0.0), "–"),
    (lambda: fmt.span([2.0, None, 1.0], str), "1.0–2.0"), (lambda: fmt.span([None], str), "–"),
    (lambda: fmt.num_range([0.0042, 0.0051], 1, 1000), "4.2–5.1"), (lambda: fmt.num_range([3.04, 2.96], 1), "3.0"),
    (lambda: fmt.code_counts({"node_lost": 1, "bus_unavailable": 3}), "`bus_unavailable` 3, `node_lost` 1"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_formatters(call, text):
    assert call() == text
