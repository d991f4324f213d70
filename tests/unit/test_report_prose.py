"""The reproduction report tells the truth by construction: its prose (tools/docgen/templates/report_template.md,
tools/docgen/templates/report_notes.md) holds no typed-in figure — every number is a placeholder the report run fills
from its own rows — and every placeholder the notes use is one the report provides."""

from __future__ import annotations

import re
import string
from pathlib import Path

import pytest

import tools.docgen.repro_facts as facts
import tools.docgen.reproduction as report
from kairos.core.policy import PolicyParams
from tools.docgen.docgen import figures_outside

SIM = report.TEMPLATES
PROSE = [SIM / "report_template.md", SIM / "report_notes.md"]

#: the scanner README/docs use too (tools/docgen/docgen.py): digits that are names, not figures, are allowed
figures_outside_placeholders = figures_outside


@pytest.mark.parametrize("path", PROSE, ids=lambda p: p.name)
def test_prose_has_no_typed_in_figures(path):
    assert figures_outside_placeholders(path.read_text()) == []


def test_the_scanner_catches_a_typed_figure():
    assert figures_outside_placeholders("Kairos cuts P95 TTFT by 40 % ({x} s) in Table 4") == [
        "Kairos cuts  TTFT by 40 % ( s) in"]
    assert figures_outside_placeholders("`sq:1` at {rps:g} RPS, P99 and §6") == []


def placeholders(text: str) -> set[str]:
    return {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(text) if name}


def test_every_note_placeholder_is_a_fact_or_a_template_value():
    notes = report.read_notes(SIM / "report_notes.md")
    needed = set().union(*(placeholders(v) for v in notes.values()))
    provided = set(report.template_values(PolicyParams(), 60.0, 1, 0.0))
    facts_src = Path(facts.__file__).read_text()
    provided |= set(re.findall(r'f\["(\w+)"\]', facts_src))
    provided |= {m for pat in re.findall(r'f\[f"(\w*)\{', facts_src) for m in (pat,)}  # f[f"t4_best_{link}"] …
    missing = {n for n in needed if n not in provided and not any(n.startswith(p) and p for p in provided)}
    assert not missing, f"notes use placeholders the report never fills: {sorted(missing)}"
    template = (SIM / "report_template.md").read_text()
    assert set(notes) <= placeholders(template), "a notes section the template does not place"
