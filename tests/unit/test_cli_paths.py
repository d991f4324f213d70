"""Output paths the CLI cannot write are usage errors (exit 2, the option named) before any work is
done, never a traceback after it; help texts print percent signs once."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kairos.cli.main import main

BAD = "/proc/kairos-no-such-dir/out"


@pytest.mark.parametrize("args,option", [
    (["sim", "--duration", "5", "--json", f"{BAD}/x.json"], "--json"),
    (["bench", "--duration", "1", "--json", f"{BAD}/x.json"], "--json"),
    (["demo", "--json", f"{BAD}/x.json"], "--json"),
    (["up", "--log-dir", BAD], "--log-dir"),
    (["up", "--log-dir", "/proc"], "--log-dir"),  # exists, not writable
    (["up", "--trace-file", f"{BAD}/t.jsonl"], "--trace-file"),
    (["demo", "--trace-file", f"{BAD}/t.jsonl"], "--trace-file"),
    (["nats-auth", "--secrets-dir", BAD], "--secrets-dir"),
    (["nats-cluster", "--conf-dir", BAD], "--conf-dir"),
    (["nats-cluster", "--secrets-dir", BAD], "--secrets-dir"),
])
def test_unwritable_output_paths_exit_2_naming_the_option(args, option):
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert option in res.output and "cannot" in res.output, res.output


def test_a_writable_json_path_is_created_and_left_alone_when_it_did_not_exist(tmp_path):
    from kairos.cli.options import writable_file

    target = tmp_path / "new" / "rows.json"
    assert writable_file(None, None, str(target)) == str(target)
    assert target.parent.is_dir() and not target.exists()  # probed, not left behind empty
    target.write_text("keep")
    writable_file(None, None, str(target))
    assert target.read_text() == "keep"  # an existing file is not truncated by the probe


@pytest.mark.parametrize("command", [["up"], ["sim"]])
def test_help_prints_percent_signs_once(command):
    out = CliRunner().invoke(main, [*command, "--help"]).output
    assert "%%" not in out and " % " in out
