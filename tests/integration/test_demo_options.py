"""``kairos demo``'s options: progress on by default, a bad workload or duration refused before
anything starts."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_demo_progress_is_on_unless_turned_off(monkeypatch):
    """Progress is on by default, also under a non-TTY stderr (CliRunner, CI, ``make run | tee``),
    where the bench client prints periodic lines instead of a bar (issue 11)."""
    from click.testing import CliRunner

    import kairos.cli.demo
    from kairos.cli.main import main

    seen = []
    monkeypatch.setattr(kairos.cli.demo, "run_demo", lambda opts, **kw: seen.append(kw["progress"]) or 0)
    for args in ([], ["--progress"], ["--no-progress"]):
        r = CliRunner().invoke(main, ["demo", *args])
        assert r.exit_code == 0, r.output
    assert seen == [True, True, False]
    assert kairos.cli.demo.progress_default(None) is True
    assert kairos.cli.demo.progress_default(False) is False

def test_demo_rejects_a_bad_workload_before_starting_anything(tmp_path, monkeypatch):
    """`kairos demo --workload nope` is a usage error at once, not after the stack came up."""
    from click.testing import CliRunner

    import kairos.cli.demo
    from kairos.cli.main import main

    started = []
    monkeypatch.setattr(kairos.cli.demo, "demo_command", lambda **o: started.append(o))
    r = CliRunner().invoke(main, ["demo", "--workload", "nope"])
    assert r.exit_code == 2 and "--workload" in r.stderr and started == []
    r = CliRunner().invoke(main, ["demo", "--duration", "1e12"])
    assert r.exit_code == 2 and "--duration" in r.stderr and started == []
