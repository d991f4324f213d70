"""``make compose-smoke``: the real ``docker-compose.yml`` run for real, on a machine without an image
registry, and torn down again.

    python ops/compose-smoke/smoke.py [--duration S] [--cold] [--remove-image] [--json PATH]

Steps (each printed with its wall time; the Docker host's part is in ``dockerhost.py``):

0. **Host lock.** One run at a time per host: a second run waits for the first (``dockerhost.host_lock``).
1. **Tools.** ``dockerd``, ``docker-compose`` (Compose 1.29) and ``debootstrap`` from Debian's
   packages (``apt-get install docker.io docker-compose debootstrap``, as root) when missing.
2. **dockerd.** If no daemon answers, one is started with ``ops/compose-smoke/daemon.json``
   (``"bridge": "none"``, no iptables: no bridge network exists, so no container can have one) and
   stopped at the end. Then what an earlier run left of the ``kairos-smoke`` project (killed before
   its teardown, or the machine restarted: dockerd starts its ``unless-stopped`` containers again)
   is removed (``dockerhost.remove_leftovers``).
   With ``--cold``, both images (below) are removed first, so the run takes the path of a machine
   that never ran it: debootstrap, then a build without a layer cache (Docker's images are what
   stays warm between cold runs of ``.ci/run``, docs/reliability.md "A cold run of CI").
3. **A local base image** (no registry to pull ``python:3.11-slim`` from): ``debootstrap --variant=minbase``
   of Debian bookworm with python3, imported as ``kairos-smoke-base:bookworm``, with this machine's
   CA bundle so pip in the build reaches the package index. Kept between runs.
4. **The Kairos image**: ``docker build --network host --build-arg PYTHON_IMAGE=<base>
   -f ops/docker/Dockerfile -t kairos:local .`` — the Dockerfile users build.
5. **The stack**: a scratch project directory with copies of ``docker-compose.yml``, ``.env`` and
   ``ops/nats/``, fresh secrets from ``kairos nats-auth`` / ``kairos nats-cluster --secrets-dir``
   (a user's own ``ops/secrets`` is never touched), and the override
   ``ops/compose-smoke/docker-compose.smoke.yml`` (what it changes and why: its header).
   ``docker-compose --profile emulated up -d``; every healthcheck must pass.
6. **Load and faults**: ``kairos bench`` (streaming, bursty, ``--duration`` s plus ``ROLLING_S``:
   ≥ 100 requests) against the ingress; once the ingress has answered ``KILL_AFTER`` requests the
   dispatcher ``dispatcher-1`` and then the agent ``prefill-1`` are SIGKILLed from the host (a crash,
   not a ``docker stop``: the restart policy applies); then every node container is restarted in
   turn (``docker-compose restart``: SIGTERM, the agent drains and exits, Docker starts it again),
   each healthy again before the next (issue 33). Checks: every request completed (none failed,
   none lost), some deflected, both crashed containers restarted by Docker and healthy again.
7. ``docker-compose ps``, the bench summary, then ``down -v`` (containers, volumes, networks; if
   that fails, the project's containers and volumes removed by their compose label) and dockerd
   stopped if step 2 started it — also when a step fails and on SIGINT, SIGTERM or SIGHUP (dockerd
   runs in its own session, so a Ctrl-C reaches it only through this cleanup). After a SIGKILL of
   this script, the next run removes what it left (step 2).

The ports of the stack (``PORTS``) must be free on 127.0.0.1 once the leftovers are gone; the run
checks that before ``up`` (something else holding them: a step that could not run).
The legacy builder keeps the build stage as an untagged image: each rebuild after a change leaves
one behind (``docker image prune`` removes them).

Exit 0 when every check passed; 1 with the failed checks listed; 2 when a step could not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dockerhost import (BASE_IMAGE, IMAGE, PROJECT, StepFailed, docker_up, ensure_base_image, ensure_tools,
                        host_lock, remove_images, remove_leftovers, remove_project, sh, start_dockerd)
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
INGRESS = "http://127.0.0.1:8000"
KILLED = ("dispatcher-1", "prefill-1")  # one dispatcher replica, one node agent
KILL_AFTER = (15, 30)  # ingress answers before each kill
#: the node containers restarted in turn under the bench after the kills (``docker-compose restart``)
NODES = ("prefill-0", "prefill-1", "decode-0", "decode-1")
#: what ``docker-compose restart -t`` gives a node before SIGKILL: its stop_grace_period (the drain's 60 s + exit)
DRAIN_GRACE_S = 75
#: seconds added to the bench for the rolling restart (four drains and restarts)
ROLLING_S = 150.0
HEALTHY_TIMEOUT_S = 240.0
KAIROS = [sys.executable, "-m", "kairos.cli.main"]


TIMES: dict[str, float] = {}  #: step name → wall time, s, of each step that finished


@contextlib.contextmanager
def step(name: str):
    """Print ``name`` and, when the block ends, its wall time; record it in ``TIMES`` only if the
    block finished (an interrupted or failed step is printed as such)."""
    t0 = time.monotonic()
    print(f"== {name}", flush=True)
    try:
        yield
    except BaseException:
        print(f"   {name}: {time.monotonic() - t0:.1f} s (did not finish)", flush=True)
        raise
    TIMES[name] = round(time.monotonic() - t0, 1)
    print(f"   {name}: {TIMES[name]:.1f} s", flush=True)


def build_image() -> None:
    sh(["docker", "build", "--network", "host", "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}",
        "-f", "ops/docker/Dockerfile", "-t", IMAGE, "."], cwd=ROOT)


#: the host ports the stack listens on (docker-compose.yml, docs/deploy.md "Ports"): NATS client,
#: cluster and monitoring, the ingress, the services' /metrics + /health
PORTS = (4222, 4223, 4224, 6222, 6223, 6224, 8222, 8223, 8224, 8000, 9100, 9101, 9102, 9110, 9111, 9112, 9113)


def ports_in_use() -> list[int]:
    """The stack's ports that something on 127.0.0.1 already listens on."""
    busy = []
    for port in PORTS:
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                busy.append(port)
    return busy


def project_dir(workdir: Path) -> Path:
    """The scratch compose project: the real file and what it reads, fresh secrets, the override."""
    proj = workdir / "project"
    (proj / "ops").mkdir(parents=True)
    for name in ("docker-compose.yml", ".env"):
        shutil.copy(ROOT / name, proj / name)
    shutil.copytree(ROOT / "ops" / "nats", proj / "ops" / "nats")
    shutil.copy(HERE / "docker-compose.smoke.yml", proj / "docker-compose.smoke.yml")
    secrets = proj / "ops" / "secrets"
    sh([*KAIROS, "nats-auth", "--secrets-dir", str(secrets)])
    sh([*KAIROS, "nats-cluster", "--secrets-dir", str(secrets)])
    return proj


def compose(proj: Path, *args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
    return sh(["docker-compose", "-p", PROJECT, "-f", "docker-compose.yml", "-f", "docker-compose.smoke.yml",
               "--profile", "emulated", *args], cwd=proj, check=check, capture=capture)


def container(proj: Path, service: str) -> str:
    ids = compose(proj, "ps", "-q", service).stdout.split()
    if not ids:
        raise StepFailed(f"no container for {service}")
    return ids[0]


def inspect(cid: str) -> dict:
    return json.loads(sh(["docker", "inspect", cid], capture=True).stdout)[0]


def wait_healthy(proj: Path, timeout_s: float = HEALTHY_TIMEOUT_S) -> dict[str, str]:
    """Poll every container until each with a healthcheck is healthy; raise :class:`StepFailed`
    naming the others (and the tail of their logs) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {}
        for cid in compose(proj, "ps", "-q").stdout.split():
            info = inspect(cid)
            name = info["Config"]["Labels"].get("com.docker.compose.service", cid)
            health = info["State"].get("Health")
            states[name] = health["Status"] if health else info["State"]["Status"]
        waiting = {n: s for n, s in states.items() if s not in ("healthy", "running")}
        if states and not waiting:
            return states
        if time.monotonic() > deadline:
            logs = {n: compose(proj, "logs", "--no-color", "--tail", "5", n, check=False).stdout for n in waiting}
            raise StepFailed(f"not healthy after {timeout_s:.0f} s: {waiting}\n" + "\n".join(logs.values()))
        time.sleep(2.0)


def answered() -> int:
    """Completion requests the ingress has answered (``kairos_ingress_requests_total``, summed)."""
    try:
        text = urllib.request.urlopen(f"{INGRESS}/metrics", timeout=5).read().decode()
    except OSError:
        return 0
    return int(sum(sample.value for family in text_string_to_metric_families(text)
                   if family.name == "kairos_ingress_requests" for sample in family.samples
                   if sample.name == "kairos_ingress_requests_total"))


def crash(proj: Path, service: str) -> int:
    """SIGKILL ``service``'s container from the host (its init process); return its restart count."""
    info = inspect(container(proj, service))
    os.kill(info["State"]["Pid"], 9)
    print(f"   SIGKILLed {service} (pid {info['State']['Pid']})", flush=True)
    return info["RestartCount"]


def rolling_restart(proj: Path, bench: subprocess.Popen) -> list[str]:
    """``docker-compose restart`` of every node container in turn (SIGTERM: the agent drains, exits, and
    Docker starts it again; issue 33), each healthy again before the next, while ``bench`` runs.
    Returns the services restarted; raises StepFailed if the bench ended first."""
    done = []
    for service in NODES:
        if bench.poll() is not None:
            raise StepFailed(f"kairos bench ended before the rolling restart reached {service}")
        t0 = time.monotonic()
        compose(proj, "restart", "-t", str(DRAIN_GRACE_S), service)
        wait_healthy(proj)
        print(f"   restarted {service} (docker-compose restart: drained, back and healthy in "
              f"{time.monotonic() - t0:.1f} s)", flush=True)
        done.append(service)
    return done


def load_and_faults(proj: Path, duration_s: float, out: Path) -> tuple[dict, dict[str, tuple[int, int]]]:
    """The bench (``duration_s`` plus :data:`ROLLING_S` for the rolling restart), two crashes mid-burst,
    then a rolling restart of the node containers; the bench report and the crashed containers'
    restart counts before their crash and once every container is healthy again (read before the
    rolling restart: a ``docker-compose restart`` sets a container's count back to 0)."""
    bench = subprocess.Popen([*KAIROS, "bench", "--url", INGRESS, "--duration", str(duration_s + ROLLING_S),
                              "--no-progress", "--json", str(out)], cwd=ROOT)
    restarts_before = {}
    base = answered()
    for service, after in zip(KILLED, KILL_AFTER):
        while answered() < base + after and bench.poll() is None:
            time.sleep(0.2)
        if bench.poll() is not None:
            raise StepFailed(f"kairos bench ended before {service} could be killed mid-burst")
        restarts_before[service] = crash(proj, service)
    wait_healthy(proj)
    restarts = {s: (n, inspect(container(proj, s))["RestartCount"]) for s, n in restarts_before.items()}
    rolling_restart(proj, bench)
    if bench.wait() != 0:
        raise StepFailed(f"kairos bench exited with {bench.returncode}")
    return json.loads(out.read_text()), restarts


def teardown(proj: Path) -> None:
    """``down -v``; if that fails, remove the project's containers and volumes by their compose
    label, and say so (nothing may be left holding the ports)."""
    p = compose(proj, "down", "-v", "--remove-orphans", check=False)
    if p.returncode == 0:
        return
    print(f"   docker-compose down exited with {p.returncode}: {(p.stderr or '')[-500:]}", flush=True)
    removed = remove_project()
    print(f"   removed by label: {removed['container']} container(s), {removed['volume']} volume(s)", flush=True)


def _terminated(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def checks(report: dict, restarts: dict[str, tuple[int, int]], states: dict[str, str]) -> list[str]:
    """The failed checks (empty: all passed). ``restarts``: each crashed container's Docker restart
    count before its crash and after it was healthy again."""
    bad = []
    if report["sent"] < 100:
        bad.append(f"only {report['sent']} requests sent (want >= 100)")
    if report["completed"] != report["sent"] or report["failed"]:
        bad.append(f"{report['completed']}/{report['sent']} completed, {report['failed']} failed: {report['errors']}")
    if not report["deflections"]:
        bad.append("no request was deflected")
    for service, (before, after) in restarts.items():
        if after <= before:
            bad.append(f"{service} was not restarted by Docker (restart count {before} -> {after})")
    bad += [f"{n} is {s} after the run" for n, s in states.items() if s not in ("healthy", "running")]
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run docker-compose.yml for real (emulated profile) on a machine without an "
                                             "image registry, under load with two containers crashed, and tear it "
                                             "down. See docs/deploy.md, 'The smoke run'.")
    ap.add_argument("--duration", type=float, default=30.0,
                    help="bench length, s (default 30: ~150 requests; the run fails with fewer than 100)")
    ap.add_argument("--cold", action="store_true",
                    help="remove the base image and kairos:local first: debootstrap and a build without cache, as on a "
                         "machine that never ran this")
    ap.add_argument("--remove-image", action="store_true",
                    help="remove kairos:local at the end (kept by default: it is the next build's cache)")
    ap.add_argument("--json", type=Path, help="write the bench report, the step times and the checks here")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.duration) and args.duration > 0):
        ap.error(f"--duration must be a positive number of seconds, got {args.duration}")
    for sig in (signal.SIGTERM, signal.SIGHUP):  # a kill takes the stack down too (the finally below)
        signal.signal(sig, _terminated)
    workdir = Path(tempfile.mkdtemp(prefix="kairos-smoke-"))
    dockerd = proj = None
    bad: list[str] = []
    row: dict = {}
    lock = contextlib.ExitStack()  # released last, after the teardown and dockerd's stop
    try:
        with step("host lock"):
            lock.enter_context(host_lock())
        with step("tools"):
            fresh = {"installed_tools": ensure_tools()}
        with step("dockerd"):
            if not docker_up():
                dockerd = start_dockerd(workdir)
        with step("leftovers"):
            fresh["removed_leftovers"] = remove_leftovers()
        if args.cold:
            with step("cold: images removed"):
                fresh["removed_images"] = remove_images()
        with step("base image"):
            fresh["built_base_image"] = ensure_base_image(workdir)
        with step("build"):
            build_image()
        with step("up"):
            busy = ports_in_use()
            if busy:
                raise StepFailed(f"ports of the stack are in use on 127.0.0.1: {busy} (another stack or server?)")
            proj = project_dir(workdir)
            compose(proj, "up", "-d", "--no-build")
            wait_healthy(proj)
        with step("bench and kills"):
            report, restarts = load_and_faults(proj, args.duration, workdir / "bench.json")
            states = wait_healthy(proj)
        bad = checks(report, restarts, states)
        print(compose(proj, "ps").stdout)
        print(f"bench: {report['completed']}/{report['sent']} completed, {report['failed']} failed, "
              f"{report['deflections']} deflected; TTFT p50 {report['ttft_ms']['p50']:.0f} ms, "
              f"p99 {report['ttft_ms']['p99']:.0f} ms; killed {', '.join(KILLED)}")
        row = {k: report[k] for k in ("sent", "completed", "failed", "errors", "deflections", "ttft_ms", "tbt_ms")}
        row.update(killed=list(KILLED), restarts={s: after for s, (_, after) in restarts.items()},
                   started_dockerd=dockerd is not None, failed_checks=bad, **fresh)
        print(f"   restarts by Docker: {row['restarts']}", flush=True)
    except StepFailed as exc:
        print(f"compose-smoke: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"compose-smoke: interrupted ({str(exc) or 'SIGINT'}); taking the stack down", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cleanup itself is not interrupted
        if proj is not None:
            with step("down"):
                teardown(proj)
                if args.remove_image:
                    sh(["docker", "image", "rm", IMAGE], check=False, capture=True)
        if dockerd is not None:
            dockerd.terminate()
            dockerd.wait(timeout=30)
            print("   stopped dockerd", flush=True)
        shutil.rmtree(workdir, ignore_errors=True)
        lock.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**row, "times_s": TIMES}, indent=1))
    for b in bad:
        print(f"FAILED: {b}", file=sys.stderr)
    print(f"compose-smoke: {'passed' if not bad else 'failed'} ({json.dumps(TIMES)})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
