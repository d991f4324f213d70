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


@pytest.fixture(autouse=True, scope="session")
def _logging_as_a_fresh_process_has_it():
    """Each pytest session starts with logging unconfigured, as in a fresh process. structlog is
    configured once per process (``kairos.runtime.telemetry.setup_logging``) with the ``sys.stderr``
    of that moment, which in a test is the session's capture file, and a module-level logger
    (``structlog.get_logger`` in ``kairos/engines/vllm/backend.py`` and others) keeps the one it built
    on first use. pytest closes that file when its session ends, so a second session in the same
    process (mutmut's stats run, then its clean run, then a forked child per mutant: ``make
    mutation``) had every log line raise ``ValueError: I/O operation on closed file`` in the service
    that wrote it: the ingress and vLLM-backend tests failed there and only there. A no-op in the
    first session of a process (nothing configured yet)."""
    import logging
    import sys

    import structlog
    from structlog._config import BoundLoggerLazyProxy

    from kairos.runtime import telemetry

    if telemetry._logging_configured:
        structlog.reset_defaults()
        telemetry._logging_configured = False
        root = logging.getLogger()
        for h in [h for h in root.handlers if getattr(h, "_kairos", False)]:
            root.removeHandler(h)
        root.setLevel(logging.WARNING)  # the standard library's default
        for name, mod in list(sys.modules.items()):
            if name.split(".")[0] == "kairos":
                for obj in list(vars(mod).values()):
                    if isinstance(obj, BoundLoggerLazyProxy):
                        vars(obj).pop("bind", None)  # the logger it cached on first use (cache_logger_on_first_use)
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
