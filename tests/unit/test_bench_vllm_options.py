"""``kairos bench`` takes ``vllm bench serve``'s spelling of its request rate, ``--request-rate``
(vllm/benchmarks/serve.py), as another name of its own ``--rps`` (kairos/cli/options.py), so a
vLLM command line's rate carries over; ``--help`` lists both names. An error names the option the
user typed; ``inf`` (vLLM's default, all at once) is refused with the reason; giving both is a
usage error."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from kairos.cli.main import main


@pytest.mark.parametrize("spelling", ["--rps", "--request-rate"])
def test_the_request_rate_under_either_name(captured, spelling):
    res = CliRunner().invoke(main, ["bench", "--no-progress", spelling, "7.5", "--duration", "4"])
    assert res.exit_code == 0, res.output
    assert captured["rps"] == 7.5 and captured["duration"] == 4.0
    assert "request_rate" not in captured  # one option, two names


def test_help_lists_the_vllm_name():
    out = CliRunner().invoke(main, ["bench", "--help"]).output
    assert "--rps FLOAT" in out and "--request-rate FLOAT" in out, out


@pytest.mark.parametrize("spelling", ["--rps", "--request-rate"])
@pytest.mark.parametrize("rate", ["0", "-2", "200000", "nan"])
def test_an_out_of_range_rate_names_the_option_typed(captured, spelling, rate):
    res = CliRunner().invoke(main, ["bench", "--no-progress", spelling, rate, "--duration", "4"])
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {spelling}: must be > 0 and <= 100000 requests/s" in res.output, res.output
    other = "--rps" if spelling == "--request-rate" else "--request-rate"
    assert other not in res.output.split("Error:", 1)[1]
    assert captured == {}  # refused before anything runs


def test_inf_says_why_and_what_to_give_instead(captured):
    res = CliRunner().invoke(main, ["bench", "--no-progress", "--request-rate", "inf"])
    assert res.exit_code == 2, res.output
    err = res.output.split("Error:", 1)[1]
    assert "--request-rate" in err and "--rps" not in err, err
    assert "all requests at once" in err and "--duration" in err and "--max-concurrency" in err, err
    assert captured == {}


def test_both_names_at_once_is_a_usage_error(captured):
    res = CliRunner().invoke(main, ["bench", "--no-progress", "--request-rate", "2", "--rps", "3"])
    assert res.exit_code == 2, res.output
    assert "--rps 3 and --request-rate 2" in res.output and "give one" in res.output, res.output
    assert captured == {}
