"""``kairos bench`` takes ``vllm bench serve``'s spelling of its request rate, ``--request-rate``
(vllm/benchmarks/serve.py), as another name of its own ``--rps`` (kairos/cli/commands/live.py), so a
vLLM command line's rate carries over; ``--help`` lists both names."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner

from kairos.cli import bench as bench_pkg
from kairos.cli.main import main


@pytest.fixture
def captured(monkeypatch) -> dict[str, Any]:
    """The options ``kairos bench`` hands to :func:`bench_cli` (which is replaced: nothing is run)."""
    got: dict[str, Any] = {}

    def fake(**opts: Any) -> dict[str, Any]:
        got.update(opts)
        return {"completed": 1}

    monkeypatch.setattr(bench_pkg, "bench_cli", fake)
    return got


@pytest.mark.parametrize("spelling", ["--rps", "--request-rate"])
def test_the_request_rate_under_either_name(captured, spelling):
    res = CliRunner().invoke(main, ["bench", "--no-progress", spelling, "7.5", "--duration", "4"])
    assert res.exit_code == 0, res.output
    assert captured["rps"] == 7.5 and captured["duration"] == 4.0
    assert "request_rate" not in captured  # one option, two names


def test_help_lists_the_vllm_name():
    out = CliRunner().invoke(main, ["bench", "--help"]).output
    assert "--rps, --request-rate FLOAT" in out, out
