"""bench/mutation.py's own logic (the mutation tier's bookkeeping; the tier itself is make mutation):
mutant names to functions, diffs to the lines a listed equivalent names, the committed lists."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_mutation", ROOT / "bench" / "mutation.py")
M = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = M  # dataclasses look their module up
_spec.loader.exec_module(M)


@pytest.mark.parametrize("mutant, function", [
    ("kairos.core.cluster.heartbeat.xǁLivenessǁheard__mutmut_3", "kairos.core.cluster.heartbeat.Liveness.heard"),
    ("kairos.core.cluster.routing.x_make_job__mutmut_12", "kairos.core.cluster.routing.make_job"),
    ("kairos.core.cluster.arbiter.xǁArbiterǁ__init____mutmut_1", "kairos.core.cluster.arbiter.Arbiter.__init__"),
])
def test_a_mutant_name_names_the_function_it_mutates(mutant, function):
    assert M.function_of(mutant) == function


def test_the_changed_lines_of_a_diff_are_its_minus_and_plus_lines_stripped():
    diff = ("--- shared/x.py\n+++ shared/x.py\n@@ -1,3 +1,3 @@\n def f(a):\n"
            "-    return a < 3\n+    return a <= 3\n     # end")
    assert M.changed_lines(diff) == ("return a < 3", "return a <= 3")
    assert M.changed_lines("--- a\n+++ a\n-x = 1\n-y = 2\n+x = 2") == ("x = 1 / y = 2", "x = 2")


def test_a_listed_equivalent_matches_only_its_function_and_both_lines():
    e = M.Equivalent("shared.x.f", "return a < 3", "return a <= 3", "a is never 3")
    assert e.matches("shared.x.f", "return a < 3", "return a <= 3")
    assert not e.matches("shared.x.g", "return a < 3", "return a <= 3")
    assert not e.matches("shared.x.f", "return a < 3", "return a > 3")


def test_a_module_score_leaves_out_listed_equivalents_and_counts_timeouts_as_detected():
    r = M.ModuleResult("shared/x.py", mutants=20, killed=16, timeout=1, survived=3, equivalent=1)
    assert r.score == pytest.approx(17 / 19)  # (16 killed + 1 timeout) / (20 − 1 equivalent)
    assert r.complete
    # mutants not run yet are neither detected nor survivors, and the module is not complete
    part = M.ModuleResult("shared/x.py", mutants=20, killed=8, not_checked=10, survived=2)
    assert part.score == pytest.approx(8 / 10) and not part.complete
    # a module without mutants (never run, or a path mutmut does not know) scores nothing
    assert M.ModuleResult("shared/empty.py").score == 0.0 and not M.ModuleResult("shared/empty.py").complete


@pytest.mark.parametrize("text, message", [
    ('[[equivalent]]\nfunction = "a.b"\nremoved = "x"\nadded = "y"\nwhy = " "\n', "g.toml entry 1: needs"),
    ('[[equivalent]]\nfunction = "a.b"\nremoved = "x"\nadded = "y"\nwhy = "w"\nwhen = "z"\n', "g.toml entry 1: unknown key"),
    ('[[equivalents]]\nfunction = "a.b"\n', "g.toml: unknown table"),
    ('[[equivalent]\n', "g.toml: "),
])
def test_a_malformed_list_is_refused_naming_the_file(tmp_path, text, message):
    (tmp_path / "g.toml").write_text(text)
    with pytest.raises(ValueError, match=message):
        M.load_equivalents(tmp_path)


def test_the_committed_lists_load_and_name_only_configured_modules():
    modules = {m.removesuffix(".py").replace("/", ".") for m in M.configured_modules()}
    for e in M.load_equivalents():
        assert any(e.function.startswith(m + ".") for m in modules), f"{e.source}: {e.function} is not mutated"
        assert e.why.strip() and (e.removed or e.added)


def test_a_run_forgets_the_recorded_results_of_its_modules_only(tmp_path):
    """mutmut 3 does not test a mutant again when only the tests changed: a run removes the mutated
    copy and the results (``mutants/<module>``, ``.meta``) of the modules it runs, and no other's."""
    for m in ("kairos/a.py", "kairos/b/c.py"):
        (tmp_path / m).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f"{m}.meta").write_text("{}")
        (tmp_path / m).write_text("x = 1\n")
    gone = M.forget_results(["kairos/b/c.py", "kairos/never_run.py"], mutants=tmp_path)
    assert gone == [tmp_path / "kairos/b/c.py", tmp_path / "kairos/b/c.py.meta"]
    assert not (tmp_path / "kairos/b/c.py.meta").exists() and not (tmp_path / "kairos/b/c.py").exists()
    assert (tmp_path / "kairos/a.py.meta").exists() and (tmp_path / "kairos/a.py").exists()


def test_a_run_drops_copies_of_deleted_files_and_refreshes_changed_data_files(tmp_path, monkeypatch):
    """mutmut copies the tree into ``mutants/`` and never deletes: a test module deleted since (issue
    34's test_claim_quorum.py) was still collected there and failed to import the modules deleted
    with it; and it copies a data file once (a stale error_codes.toml failed the docs test). The
    copies of files the checkout has stay; Python files are left to mutmut."""
    checkout, mutants = tmp_path / "checkout", tmp_path / "mutants"
    for rel, text in (("tests/unit/test_kept.py", "x = 1\n"), ("kairos/codes.toml", "new\n"), ("kairos/m.py", "y = 1\n")):
        (checkout / rel).parent.mkdir(parents=True, exist_ok=True)
        (checkout / rel).write_text(text)
    for rel, text in (("tests/unit/test_kept.py", "x = 1\n"), ("tests/unit/test_deleted.py", "import gone\n"),
                      ("kairos/codes.toml", "old\n"), ("kairos/m.py", "mutated\n"), ("kairos/m.py.meta", "{}")):
        (mutants / rel).parent.mkdir(parents=True, exist_ok=True)
        (mutants / rel).write_text(text)
    monkeypatch.setattr(M, "ROOT", checkout)
    changed = M.sync_copies(mutants=mutants)
    assert sorted(changed) == sorted([mutants / "tests/unit/test_deleted.py", mutants / "kairos/codes.toml"])
    assert (mutants / "kairos/m.py.meta").exists()  # mutmut's results stay
    assert not (mutants / "tests/unit/test_deleted.py").exists() and (mutants / "kairos/codes.toml").read_text() == "new\n"
    assert (mutants / "kairos/m.py").read_text() == "mutated\n" and (mutants / "tests/unit/test_kept.py").exists()
