"""The compose tier's tests (``pytest.mark.compose``): they need Debian's ``docker-compose``, which
``make compose-smoke`` installs (``ops/compose-smoke/smoke.py``) and then runs them with it. The
unit tier deselects them, so no tier passes or skips by what an earlier run left on the machine
(issue 32)."""

from __future__ import annotations

import shutil


def compose_exe() -> str:
    """The ``docker-compose`` executable.

    Raises:
        AssertionError: it is not installed (a compose-tier test run outside ``make compose-smoke``).
    """
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is not installed: run the compose tier with make compose-smoke (it installs it)"
    return exe
