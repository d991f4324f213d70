"""``kairos up``'s banner (kairos/cli/up_plan.py ``banner``): its "Try" line is a command a user pastes."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from kairos.cli.up_plan import UpOptions, banner


def _try_line(opts: UpOptions) -> str:
    text = banner(opts, [], Path("/tmp/logs"), Path("/tmp/targets.json"), None)
    return next(line for line in text.splitlines() if line.startswith("Try "))[len("Try"):].strip()


def _argv_in_a_shell(cmd: str, key: str) -> list[str]:
    """The argv the shell gives ``curl`` for ``cmd`` with ``KEY`` set (curl replaced by printf)."""
    script = f"KEY={shlex.quote(key)}; curl() {{ printf '%s\\0' \"$@\"; }}; {cmd}"
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout.decode()
    return out.split("\0")[:-1]


def test_the_try_line_sends_the_key_the_shell_holds(monkeypatch):
    monkeypatch.delenv("KAIROS_API_KEYS", raising=False)
    monkeypatch.delenv("KAIROS_API_KEY_FILE", raising=False)
    argv = _argv_in_a_shell(_try_line(UpOptions(api_keys=("sk-one",))), "sk-from-the-shell")
    assert "Authorization: Bearer sk-from-the-shell" in argv  # was the literal '$KEY' in single quotes
    assert argv[argv.index("-d") + 1].startswith('{"model": ')


def test_an_open_api_sends_no_authorization_header(monkeypatch):
    monkeypatch.delenv("KAIROS_API_KEYS", raising=False)
    monkeypatch.delenv("KAIROS_API_KEY_FILE", raising=False)
    argv = _argv_in_a_shell(_try_line(UpOptions()), "unused")
    assert not any(a.startswith("Authorization") for a in argv)
