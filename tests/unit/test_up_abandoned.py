"""A ``kairos up`` killed with SIGKILL leaves its run directory (generated NATS passwords, JetStream
store); the next ``kairos up`` removes what a dead supervisor left (kairos/cli/up.py ``reap_abandoned``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kairos.cli.up import OWNER_FILE, reap_abandoned


def _run_dir(root: Path, name: str, owner: int | None, log: str = "") -> Path:
    d = root / name
    (d / "nats-credentials").mkdir(parents=True)
    (d / "nats-credentials" / "ingress.password").write_text("secret")
    (d / "jetstream").mkdir()
    (d / "logs").mkdir()
    (d / "logs" / "ingress.log").write_text(log)
    if owner is not None:
        (d / OWNER_FILE).write_text(f"{owner}\n")
    return d


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_run_directory_of_a_dead_supervisor_is_cleared_and_its_logs_kept(tmp_path):
    dead = _dead_pid()
    gone = _run_dir(tmp_path, "kairos-up-gone", dead, log="started\n")
    empty = _run_dir(tmp_path, "kairos-up-empty", dead)
    alive = _run_dir(tmp_path, "kairos-up-alive", os.getpid())
    legacy = _run_dir(tmp_path, "kairos-up-legacy", None)
    other = _run_dir(tmp_path, "other-gone", dead)
    assert reap_abandoned(tmp_path) == [(empty, dead), (gone, dead)]
    assert sorted(p.relative_to(gone).as_posix() for p in gone.rglob("*")) == ["logs", "logs/ingress.log"]
    assert not empty.exists()  # no log worth keeping: nothing left
    for kept in (alive, legacy, other):  # a running supervisor's, one without owner file, not kairos up's
        assert (kept / "nats-credentials" / "ingress.password").read_text() == "secret"
    assert reap_abandoned(tmp_path) == []  # idempotent


def test_an_unreadable_owner_file_is_left_alone(tmp_path):
    d = _run_dir(tmp_path, "kairos-up-x", None)
    (d / OWNER_FILE).write_text("not a pid\n")
    assert reap_abandoned(tmp_path) == []
    assert (d / "jetstream").is_dir()
