"""Unit-tier settings (not test-wide: the vLLM tier runs tests/vllm under a virtualenv without
Hypothesis or the policy's dependencies). The ``mutation`` Hypothesis profile (``make mutation`` passes
``--hypothesis-profile=mutation``) draws the same examples in every run and keeps no example
database, so a mutant is killed or not by the tests alone, never by the luck of a draw or by a
failing example that an earlier mutant left behind."""

from hypothesis import settings

settings.register_profile("mutation", derandomize=True, database=None)


import pytest  # noqa: E402

from kairos.core.policy import estimates as _estimates


@pytest.fixture(autouse=True)
def _fresh_sweep_cache():
    """Each test starts without the policy's memoised sweeps (``kairos.core.policy.estimates._SWEEPS``, a
    process-wide cache): a test must not pass on a schedule an earlier test computed, and mutmut's
    map of which test exercises which function (its stats run, all tests in one process) must not
    miss a test whose sweeps were already cached."""
    _estimates._SWEEPS.clear()
    yield


@pytest.fixture
def captured(monkeypatch) -> dict:
    """The options ``kairos bench`` hands to ``bench_cli``, which is replaced: nothing is run
    (test_bench_vllm_options.py, test_bench_num_prompts.py)."""
    from kairos.cli import bench as bench_pkg

    got: dict = {}

    def fake(**opts) -> dict:
        got.update(opts)
        return {"completed": 1}

    monkeypatch.setattr(bench_pkg, "bench_cli", fake)
    return got
