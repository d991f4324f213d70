"""``kairos profile``: measure one decode node's step latencies and publish a fitted latency model.

Against a running cluster (``--nats-url``, the node named by ``--node``), or self-contained:

* ``--emulated``: a bundled nats-server and one emulated decode-node agent as child processes
  (``--truth-profile``/``--truth-scale`` set what its steps really take; the fit should recover that,
  not the model the node predicts with);
* ``--vllm``: a bundled nats-server, one vLLM-CPU server with the ``kairos.engines.vllm.plugin`` scheduler plugin
  (the tiny model of ``python -m kairos.engines.vllm.tiny_model --cached`` unless ``--model DIR``; engine
  limits from ``--base-profile``, started as ``kairos up --engine vllm`` starts a node:
  :func:`kairos.cli.up.vllm_node`) and its decode-node agent. The fit then measures the real engine:
  the samples are the plugin's own step records (``wall_ms`` of the forward pass).

The grid is ``kairos.core.model.profiling``; profiling the node once it runs (connect, grid, fit,
publish, write) is :func:`kairos.services.profiler.session.profile_node`, which ``python -m
kairos.services.profiler`` runs on a node of a running cluster; ``--testbed`` is
:mod:`kairos.cli.testbed_profile`. This module checks the options (:class:`ProfileOptions`) and
starts/stops the self-contained modes' processes. The host's load average before and after the run
is recorded in the artifact's metadata (``load_average``): step times on a shared CPU depend on it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, fields
from pathlib import Path

from kairos.engines.vllm.facts import VLLM_ENGINE_LABEL, model_card
from kairos.engines.vllm.launch import VllmServer
from kairos.cli.up import kill_group, start_bundled_nats, stop_process
from kairos.services.node_agent.config import AgentConfig
from kairos.services.profiler.command import DEFAULT_NATS_URL
from kairos.services.profiler.session import NodeProfileOptions, command_line, profile_node, write_artifact
from kairos.runtime.envconfig import to_env
from kairos.core.model.fitting import FitRefused
from kairos.core.model.latency import DEFAULT_PROFILE, LatencyModel, load_profile
from kairos.core.model.profiling import fit_summary


class ProfileOptionsError(ValueError):
    """:class:`ProfileOptions` that cannot run together; ``option`` is the CLI option to blame."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


#: (option, default, default with ``vllm``): the engine-dependent defaults of :class:`ProfileOptions`
#: (without ``vllm``: a running cluster's, :class:`kairos.services.profiler.session.NodeProfileOptions`)
ENGINE_DEFAULTS = (("grid", NodeProfileOptions.grid, "cpu-testbed"),
                   ("background", NodeProfileOptions.background, "deflect"),
                   ("base_profile", DEFAULT_PROFILE, "cpu-testbed-vllm"),
                   ("served_model", NodeProfileOptions.served_model, "kairos-vllm"))
#: the provenance's engine label of ``--emulated``
EMULATED_ENGINE_LABEL = "emulated (kairos kairos.core.engine_model)"


@dataclass(frozen=True)
class ProfileOptions:
    """Options of ``kairos profile`` (see ``kairos profile --help``). ``None`` in ``grid``,
    ``background``, ``base_profile``, ``served_model`` means the engine's default
    (:data:`ENGINE_DEFAULTS`), in ``publish``: publish unless the node is self-contained
    (``emulated``/``vllm``: its NATS goes away with the run)."""

    node: str = "decode-0"
    nats_url: str | None = None
    emulated: bool = False
    vllm: bool = False  #: self-contained with one vLLM-CPU decode node (see the module docstring)
    model_dir: str | None = None  #: ``vllm``: model directory (default: the cached model of ``model_size``)
    model_size: str = "testbed"  #: ``vllm`` without ``model_dir``: ``kairos.engines.vllm.tiny_model`` size (testbed, tiny)
    vllm_startup_timeout_s: float = 600.0
    records_out: str | None = None  #: also write the raw step records here (JSON lines of StepRecordEvent)
    command: str | None = None  #: the command line recorded in the provenance (None: this process's ``kairos …`` argv)
    node_profile: str = DEFAULT_PROFILE
    truth_profile: str | None = None
    truth_scale: float = 1.0
    grid: str | None = None
    name: str | None = None
    version: str | None = None
    out: str | None = None
    publish: bool | None = None
    max_mape: float | None = 10.0
    base_profile: str | None = None
    engine: str | None = None
    served_model: str | None = None
    label: str | None = None
    background: str | None = None
    quiet: bool = False
    connect_timeout_s: float = 10.0
    replay: str | None = None  #: workload spec replayed after the grid (``azure-code:busiest``, ``bursty``)
    replay_duration_s: float = 30.0
    replay_rps: float | None = None
    #: ``vllm``: keep a second vLLM server prefilling on core 0 meanwhile (:mod:`kairos.cli.coload`);
    #: None: on with ``vllm`` on ≥ 2 cores
    co_load: bool | None = None
    #: ``vllm``: profile the whole 1P1D testbed from its engines' steps while it serves this workload
    #: spec (:mod:`kairos.cli.testbed_profile`) instead of running the grid on one node
    testbed: str | None = None
    testbed_rps: float | None = None  #: None: the A/B's rate (kairos.cli.demo.VLLM_AB_RPS)
    testbed_duration_s: float = 60.0
    testbed_seed: int = 2

    def __post_init__(self) -> None:
        """Fill the engine defaults; raises :class:`ProfileOptionsError` for combinations that cannot run."""
        if self.emulated and self.vllm:
            raise ProfileOptionsError("--vllm", "--emulated and --vllm are two different self-contained nodes: choose one")
        if (self.emulated or self.vllm) and self.nats_url:
            raise ProfileOptionsError("--nats-url", f"--{'vllm' if self.vllm else 'emulated'} starts its own NATS; do "
                                                    "not pass --nats-url with it")
        if self.model_dir and not self.vllm:
            raise ProfileOptionsError("--model", "--model is the model of the --vllm server; pass --vllm with it")
        if self.publish and (self.emulated or self.vllm):
            raise ProfileOptionsError("--publish", "--publish needs a cluster's NATS (--nats-url): the NATS of "
                                                   "--emulated/--vllm goes away with it; load the written artifact "
                                                   "with --profile instead")
        if self.vllm and self.background == "handoff":
            raise ProfileOptionsError("--background", "vLLM cannot pull the KV cache of a pseudo prefill node: use "
                                                      "--background deflect")
        for name, default, vllm_default in ENGINE_DEFAULTS:
            if getattr(self, name) is None:
                object.__setattr__(self, name, vllm_default if self.vllm else default)
        if self.testbed is not None and not self.testbed.strip():
            raise ProfileOptionsError("--testbed", "--testbed needs a workload spec (e.g. bursty)")
        if self.testbed and not self.vllm:
            raise ProfileOptionsError("--testbed", "--testbed profiles the vLLM-CPU testbed: pass --vllm with it")
        if self.testbed and (self.replay or self.co_load):
            raise ProfileOptionsError("--testbed", "--testbed replays its workload on the whole testbed; --replay and "
                                                   "--co-load belong to the one-node grid")
        if self.testbed:
            from kairos.cli.demo import VLLM_AB_RPS

            object.__setattr__(self, "co_load", False)
            if self.testbed_rps is None:
                object.__setattr__(self, "testbed_rps", VLLM_AB_RPS)
        if self.co_load and not self.vllm:
            raise ProfileOptionsError("--co-load", "--co-load starts a second vLLM server: pass --vllm with it")
        if self.co_load and (os.cpu_count() or 1) < 2:
            raise ProfileOptionsError("--co-load", "--co-load needs a second core for the other engine")
        if self.co_load is None:
            object.__setattr__(self, "co_load", self.vllm and (os.cpu_count() or 1) >= 2)
        if self.publish is None:
            object.__setattr__(self, "publish", not (self.emulated or self.vllm))

    def node_options(self) -> NodeProfileOptions:
        """What profiling the node takes once it runs (the options of the same names; the bundled
        NATS of ``emulated``/``vllm`` has no login; ``vllm`` measures its engine facts and labels
        the engine :data:`~kairos.engines.vllm.facts.VLLM_ENGINE_LABEL` unless ``engine`` is given;
        the provenance's command is this process's ``kairos …`` argv unless ``command`` is)."""
        same = {f.name: getattr(self, f.name) for f in fields(NodeProfileOptions) if hasattr(self, f.name)}
        return NodeProfileOptions(**{**same, "engine": self.engine or (
            EMULATED_ENGINE_LABEL if self.emulated else VLLM_ENGINE_LABEL if self.vllm else "unknown"),
            "command": command_line("kairos") if self.command is None else self.command,
            "login": not (self.emulated or self.vllm), "measure_engine_facts": self.vllm})


def _spawn(stack: ExitStack, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A child in its own session (a terminal's Ctrl-C reaches only this process, which stops the
    children in order), stopped when ``stack`` closes: SIGTERM, SIGKILL after 10 s, then whatever is
    left of its process group (a vLLM server's resource tracker outlived its server)."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(Path(__file__).resolve().parents[2]), start_new_session=True)
    stack.callback(kill_group, proc)  # callbacks run last-in first-out: after stop_process
    stack.callback(stop_process, proc)
    return proc


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _start_node(stack: ExitStack, opts: ProfileOptions, base: LatencyModel) -> tuple[str, list[Path], dict]:
    """``--emulated`` / ``--vllm``: a bundled nats-server and one decode node (child processes, stopped
    when ``stack`` closes). Returns the NATS URL, the children's log files and provenance of the
    engine (``--vllm``: the model's architecture, :func:`model_card`).

    Raises:
        RuntimeError: the nats-server or the vLLM server did not start (with its last log lines).
        FileNotFoundError: no vLLM virtualenv (``--vllm``).
    """
    url = start_bundled_nats(stack, "kairos-profile-nats-")
    tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kairos-profile-")))
    engine: dict = {}
    logs = []
    info: dict = {}
    if opts.vllm:
        from kairos.engines.vllm.launch import cached_tiny_model, vllm_python
        from kairos.cli.up import vllm_node

        py = vllm_python()
        model_dir = opts.model_dir or cached_tiny_model(py, opts.model_size)
        info["model_card"] = model_card(model_dir)
        ncpu = os.cpu_count() or 1  # the core `kairos up --engine vllm` gives decode-0 of a 1P1D stack
        srv, engine = vllm_node(opts.node, "decode", model_dir, opts.served_model, base, tmp,
                                omp_cpus=str(min(1, ncpu - 1)))
        servers = [(srv, tmp / "vllm.log")]
        if opts.co_load:  # prefill-0's server, where `kairos up` puts it (kairos/cli/coload.py)
            servers.append((vllm_node("prefill-0", "prefill", model_dir, opts.served_model, base, tmp,
                                      omp_cpus="0")[0], tmp / "vllm-co-load.log"))
        procs = [_spawn(stack, s.argv(py), s.env(), log) for s, log in servers]  # both start at once
        for (s, log), proc in zip(servers, procs):
            logs.append(log)
            _wait_vllm(s, proc, log, opts.served_model, opts.vllm_startup_timeout_s)
        if opts.co_load:
            from kairos.cli.coload import CoLoad

            co, card = servers[1][0], info["model_card"]
            load = CoLoad(co.url, co.auth_headers(), opts.served_model, int(card.get("vocab_size") or 32000),
                          min_prompt_tokens=256, max_prompt_tokens=base.engine.max_model_len - 1)
            stack.callback(load.stop)
            info["co_load"] = load.start().stop  # called when the measurements end: what it ran
    node_profile = opts.base_profile if opts.vllm else opts.node_profile
    cfg = AgentConfig(node_id=opts.node, role="decode", nats_url=url, metrics_port=-1,
                      profile=os.path.abspath(node_profile) if Path(node_profile).exists() else node_profile,
                      truth_profile=os.path.abspath(opts.truth_profile) if opts.truth_profile and
                      Path(opts.truth_profile).exists() else opts.truth_profile,
                      truth_scale=opts.truth_scale, log_format="json", log_level="warning", **engine)
    log = tmp / "agent.log"
    logs.append(log)
    _spawn(stack, [sys.executable, "-m", "kairos.services.node_agent"],
           {**os.environ, **to_env(cfg), "PYTHONUNBUFFERED": "1"}, log)
    return url, logs, info


def _wait_vllm(srv: VllmServer, proc: subprocess.Popen, log: Path, served_model: str, timeout_s: float) -> None:
    """Wait (bounded) until the vLLM server ``srv`` answers
    ``/v1/models``, then send one short warm-up completion (the first forward passes are slow and
    would be outliers of the fit); both with the server's key."""
    import json
    import urllib.request

    from kairos.cli.up import _get_json

    url, auth = srv.url, srv.auth_headers()
    deadline = time.monotonic() + timeout_s
    while _get_json(f"{url}/v1/models", auth) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {proc.returncode} during startup:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the vLLM server did not start within {timeout_s:g} s:\n{_tail(log)}")
        time.sleep(0.5)
    body = json.dumps({"model": served_model, "prompt": list(range(3, 400)), "max_tokens": 16,
                       "cache_salt": "kairos-profile-warm-up"}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json", **auth})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        r.read()


def run_profile(opts: ProfileOptions) -> LatencyModel:
    """Profile, fit, write the artifact, publish (:func:`kairos.services.profiler.session.profile_node`
    on the node of a running cluster or the one ``emulated``/``vllm`` starts, or the whole testbed:
    :func:`kairos.cli.testbed_profile.run_testbed_profile`). Prints the fit report on stdout
    (:func:`kairos.services.profiler.session.write_artifact`).

    Raises:
        FitRefused: held-out MAPE above ``max_mape`` (nothing written or published).
        kairos.services.profiler.results.ProfileRunError: the node did not run the profiler's work.
        RuntimeError: the bundled nats-server did not start, or NATS could not be reached.
    """
    base = load_profile(opts.base_profile)
    with ExitStack() as stack:
        logs: list[Path] = []
        info: dict = {}
        try:
            if opts.testbed:
                from kairos.cli.testbed_profile import run_testbed_profile

                model, revisions = run_testbed_profile(opts, base), {}
            else:
                if opts.emulated or opts.vllm:
                    url, logs, info = _start_node(stack, opts, base)
                else:
                    url = opts.nats_url or DEFAULT_NATS_URL
                model, revisions = asyncio.run(profile_node(opts.node_options(), url, base, info))
        except FitRefused as exc:
            print(fit_summary(exc.model))
            raise
        except Exception:
            for log in logs:  # the bundled node's logs go with the temporary directory: show their ends
                print(f"kairos profile: last lines of {log.name}:\n{_tail(log)}", file=sys.stderr)
            raise
    write_artifact(model, opts.out, revisions)
    return model
