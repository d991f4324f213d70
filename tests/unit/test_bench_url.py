"""``kairos bench --url`` (kairos/cli/bench/client.py ``check_url``): the base URL, as ``vllm bench
serve``'s ``--base-url`` (requests go to ``{url}/v1/completions``). An OpenAI client's base URL ends
in ``/v1``; given one, the bench used to ask ``/v1/v1/models``, got 404 and advised ``--model``,
after which every request 404'd on ``/v1/v1/completions`` (a new user's trial). A trailing ``/v1``
is now dropped with a one-line note; the 404 advice names the base URL."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kairos.cli.bench import check_url
from kairos.cli.main import main
from tests.unit.fake_openai import FakeOpenAI, serve


@pytest.mark.parametrize("given, base", [
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
    ("https://gw.example/llm/v1", "https://gw.example/llm"),  # a proxy prefix stays
    ("http://h:1/v10", "http://h:1/v10"),  # not the /v1 segment
    ("http://h:1/", "http://h:1"),
])
def test_a_trailing_v1_is_dropped(given, base):
    assert check_url(given) == base


def test_the_note_is_printed_only_when_a_v1_path_was_dropped():
    from kairos.cli.bench.client import v1_note

    for given in ("http://v1", "http://v1:8000", "http://h:1/v10", "http://h:1/"):  # a host named v1 is no path
        assert v1_note(given, check_url(given)) is None, given
    assert "ends in /v1; using http://h:1 " in v1_note("http://h:1/v1/", "http://h:1")


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_bench_against_a_url_ending_in_v1_sends_to_v1_completions(tmp_path, suffix):
    out = tmp_path / "b.json"
    fake = FakeOpenAI()
    with serve(fake) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url + suffix, "--no-progress", "--workload", "lpld",
                                        "--num-prompts", "3", "--rps", "100", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert len(fake.bodies) == 3  # they reached /v1/completions (the fake has no /v1/v1/...)
    rep = json.loads(out.read_text())
    assert rep["completed"] == 3 and rep["url"] == url
    assert f"ends in /v1; using {url}" in res.stderr


def test_a_404_on_models_asks_whether_the_url_is_the_base_url():
    with serve(FakeOpenAI()) as url:
        res = CliRunner().invoke(main, ["bench", "--url", url + "/api", "--no-progress", "--workload", "lpld",
                                        "--num-prompts", "1", "--rps", "1"])
    assert res.exit_code == 2, res.output
    assert "HTTP 404" in res.stderr and "without /v1" in res.stderr and "--model" in res.stderr
