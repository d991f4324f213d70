"""The Docker host of ``make compose-smoke`` (``smoke.py``): the tools, a dockerd of its own, the base
image, and what an earlier run left behind.

Two runs must not share one Docker host at once (both talk to one dockerd, the first to finish stops
it, both want the stack's host ports): :func:`host_lock` makes a second run wait for the first. A run
that never reached its teardown (the script SIGKILLed, the machine restarted) leaves the project's
containers behind, and since they are ``restart: unless-stopped`` the next dockerd starts them again,
holding every port of the stack; the next run then refused with "ports of the stack are in use" (a
cold run of CI did, issue 32). :func:`remove_leftovers` takes them down first: the project name
:data:`PROJECT` belongs to the smoke run, and while the lock is held no other run is using it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE_IMAGE = "kairos-smoke-base:bookworm"
IMAGE = "kairos:local"
#: the compose project name of the smoke run (``docker-compose -p``): a container or volume that
#: carries it and exists while no run holds :func:`host_lock` is a leftover
PROJECT = "kairos-smoke"
#: how long a run waits for another one on the same host to finish, s (a full run takes ~10 min)
LOCK_WAIT_S = 1800.0


class StepFailed(Exception):
    """A step could not run (exit 2), as opposed to a check that failed (exit 1)."""


def sh(cmd: list[str], *, check: bool = True, capture: bool = False, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd``; raise :class:`StepFailed` with its output's tail when ``check`` and it fails."""
    p = subprocess.run(cmd, text=True, capture_output=capture or check, **kw)
    if check and p.returncode != 0:
        tail = ((p.stdout or "") + (p.stderr or ""))[-2000:]
        raise StepFailed(f"{' '.join(cmd)} exited with {p.returncode}:\n{tail}")
    return p


def ensure_tools() -> bool:
    """Install what is missing (as root); True if something was installed."""
    missing = [t for t in ("dockerd", "docker-compose", "debootstrap") if shutil.which(t) is None]
    if not missing:
        return False
    if os.geteuid() != 0:
        raise StepFailed(f"missing {', '.join(missing)}; install Debian's docker.io docker-compose debootstrap (as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh(["apt-get", "update", "-q"], env=env)
    sh(["apt-get", "install", "-y", "-q", "docker.io", "docker-compose", "debootstrap"], env=env)
    return True


def docker_up() -> bool:
    return sh(["docker", "info"], check=False, capture=True).returncode == 0


def start_dockerd(workdir: Path) -> subprocess.Popen:
    """Start dockerd with the smoke configuration; return it once the API answers (≤ 60 s)."""
    log = open(workdir / "dockerd.log", "w")
    # its own session: a Ctrl-C in the terminal must not stop it before the stack is taken down
    proc = subprocess.Popen(["dockerd", "--config-file", str(HERE / "daemon.json"),
                             "--pidfile", str(workdir / "dockerd.pid")], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 60.0
    while not docker_up():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = (workdir / "dockerd.log").read_text()[-1500:]
            raise StepFailed(f"dockerd did not start; the end of its log:\n{tail}")
        time.sleep(0.5)
    print("   started dockerd (stopped again at the end)", flush=True)
    return proc


def ensure_base_image(workdir: Path) -> bool:
    """Make the base image unless it exists; True if it was made."""
    if sh(["docker", "image", "inspect", BASE_IMAGE], check=False, capture=True).returncode == 0:
        return False
    root = workdir / "rootfs"
    sh(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python-is-python3,ca-certificates",
        "bookworm", str(root)])
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if ca.is_file():  # this machine's trust store (a proxy's CA included): pip in the build uses it
        shutil.copy(ca, root / "etc/ssl/certs/ca-certificates.crt")
        (root / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    sh(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout)
    tar.wait()
    shutil.rmtree(root, ignore_errors=True)
    return True


def remove_images() -> list[str]:
    """Remove :data:`IMAGE` and :data:`BASE_IMAGE` and the build cache (``--cold``); the ones that
    existed. Raises StepFailed when one cannot be removed (a container of it still running)."""
    removed = []
    for image in (IMAGE, BASE_IMAGE):
        if sh(["docker", "image", "inspect", image], check=False, capture=True).returncode != 0:
            continue
        r = sh(["docker", "image", "rm", "-f", image], check=False, capture=True)
        if r.returncode != 0:
            raise StepFailed(f"--cold: could not remove {image}: {r.stderr.strip()}")
        removed.append(image)
    sh(["docker", "image", "prune", "-f"], check=False, capture=True)  # the untagged build stages
    sh(["docker", "builder", "prune", "-a", "-f"], check=False, capture=True)
    print(f"   removed: {', '.join(removed) or 'nothing (no image was there)'}", flush=True)
    return removed




def lock_path() -> Path:
    """The host-wide lock file: in ``/run/lock`` (cleared at boot) when it is writable, else in the
    temporary directory."""
    run_lock = Path("/run/lock")
    base = run_lock if run_lock.is_dir() and os.access(run_lock, os.W_OK) else Path(tempfile.gettempdir())
    return base / "kairos-compose-smoke.lock"


@contextlib.contextmanager
def host_lock(path: Path | None = None, wait_s: float = LOCK_WAIT_S, poll_s: float = 0.5):
    """Hold an exclusive ``flock`` on ``path`` (default :func:`lock_path`) for the block. The kernel
    releases it when the holder exits, however it exits, so a killed run never blocks the next.

    Args:
        path: the lock file (created when missing).
        wait_s: how long to wait for another holder, s.
        poll_s: the interval between attempts while waiting, s.

    Raises:
        StepFailed: another process held it for ``wait_s``.
    """
    path = path or lock_path()
    with open(path, "a+") as f:
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StepFailed(f"another compose smoke run held {path} for {wait_s:.0f} s") from None
                if not said:
                    print(f"   another compose smoke run holds {path}: waiting for it (≤ {wait_s:.0f} s)", flush=True)
                    said = True
                time.sleep(poll_s)
        try:
            yield path
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove_project(project: str = PROJECT) -> dict[str, int]:
    """Remove every container (running or not) and volume labelled with the compose ``project``;
    return how many of each were removed. Never raises: what cannot be removed stays and the port
    check before ``up`` says so."""
    label = f"label=com.docker.compose.project={project}"
    removed = {}
    for kind in ("container", "volume"):
        ids = sh(["docker", kind, "ls", "-aq" if kind == "container" else "-q", "--filter", label],
                 check=False, capture=True).stdout.split()
        if ids:
            sh(["docker", kind, "rm", "-f", *ids], check=False, capture=True)
        removed[kind] = len(ids)
    return removed


def remove_leftovers() -> dict[str, int]:
    """What an earlier run left of :data:`PROJECT` (module docstring), removed and reported; to be
    called with :func:`host_lock` held and dockerd up."""
    removed = remove_project()
    if any(removed.values()):
        print(f"   removed what an earlier run left (killed before its teardown, or the machine restarted): "
              f"{removed['container']} container(s), {removed['volume']} volume(s) of project {PROJECT}", flush=True)
    return removed
