"""Click pieces the ``kairos`` subcommands share: output-path checks, the ``--policy`` type (read
from the policy table, :mod:`kairos.core.policy.registry`), the α/β/τ/TTFT-SLO options (defaults from
:data:`kairos.core.policy.DEFAULT_PARAMS`), the workload options and their size check.

Every check here turns bad input into a click usage error (exit 2) naming the option, before any
work starts.
"""

from __future__ import annotations

import functools
import math
import tempfile
from pathlib import Path
from typing import Any, Callable

import click

from kairos.core.model.latency import LatencyModel, LatencyProfileError, load_profile
from kairos.core.policy import DEFAULT_PARAMS, Policy, PolicyError, PolicyParams, parse_policies, parse_policy
from kairos.core.policy.registry import SHARED_PARAMS, policy_help
from kairos.core.workload.workloads import MAX_REQUESTS, WorkloadSizeError, check_workload_size


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
    try:
        Path(value).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=value):  # exists, but can we write into it?
            pass
    except OSError as exc:
        raise click.BadParameter(f"cannot create or write into {value}: {exc.strerror or exc}") from None
    return value


def non_empty(value: str | None, name: str) -> str | None:
    """A click option value that must not be an empty string (None: not given)."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty", param_hint=name)
    return value


def load_model_or_exit(profile: str, option: str = "--profile") -> LatencyModel:
    """Load a profile by name or path, or exit 2 with the reason (naming ``option``)."""
    try:
        return load_profile(profile)
    except LatencyProfileError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None


class PolicyType(click.ParamType):
    """A policy spec of the policy table (``kairos``, ``sl:1024``) parsed into a
    :class:`~kairos.core.policy.Policy`; ``many``: a comma list, parsed into a list of them; ``live``:
    for a command that runs the stack, which refuses the simulator-only policies. A bad spec is a
    usage error (exit 2) whose message lists the known policies."""

    name = "policy"

    def __init__(self, live: bool = False, many: bool = False) -> None:
        self.live, self.many = live, many

    def convert(self, value: Any, param, ctx) -> Policy | list[Policy]:
        if isinstance(value, Policy) or (self.many and isinstance(value, list)):
            return value
        try:
            return parse_policies(value) if self.many else parse_policy(value, live=self.live)
        except PolicyError as exc:
            self.fail(str(exc), param, ctx)


def policy_option(default: str, live: bool = False, many: bool = False) -> Callable:
    """``--policy`` with its help generated from the policy table (:func:`~kairos.core.policy.registry.policy_help`)."""
    lead = "Comma list of policies: " if many else ""
    return click.option("--policy", "policies" if many else "policy", type=PolicyType(live, many), default=default,
                        show_default=True, metavar="POLICIES" if many else "POLICY",
                        help=lead + policy_help(live))


def policy_params_options(fn):
    """Shared options for α, β, τ and the TTFT SLO (one PolicyParams for every subcommand; defaults:
    :data:`kairos.core.policy.DEFAULT_PARAMS`)."""
    d = DEFAULT_PARAMS
    opts = [
        click.option("--alpha", type=float, default=d.alpha, show_default=True, help="α ≥ 1, Eq. 7 TTFT margin."),
        click.option("--beta", type=float, default=d.beta, show_default=True,
                     help="β, TBT safety factor (Eq. 5); kairos up --engine vllm without it: 1 ÷ the P95 of the "
                          "profile's held-out mixed steps' measured ÷ predicted time (kairos.core.model.latency.tbt_safety_beta)."),
        click.option("--tbt-slo-ms", type=float, default=d.tbt_slo_ms, show_default=True,
                     help="τ, TBT SLO in ms (kairos up --engine vllm without it: the CPU testbed's, 150)."),
        click.option("--ttft-slo-ms", type=float, default=d.ttft_slo_ms, show_default=True,
                     help="TTFT SLO in ms (kairos up --engine vllm without it: the CPU testbed's, 5000)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def make_params(alpha: float, beta: float, tbt_slo_ms: float, ttft_slo_ms: float, **extra) -> PolicyParams:
    """Build PolicyParams or exit 2 naming the bad value."""
    try:
        return PolicyParams(alpha=alpha, beta=beta, tbt_slo_ms=tbt_slo_ms, ttft_slo_ms=ttft_slo_ms, **extra)
    except PolicyError as exc:
        msg = str(exc)
        field = msg.split(" ", 1)[0]
        if field in SHARED_PARAMS:  # name the flag the user typed
            msg = f"--{field.replace('_', '-')}: {msg}"
        raise click.UsageError(msg) from None


def workload_options(default_duration_s: float, vllm_names: bool = False):
    """The workload options `kairos sim` and `kairos bench` share (``kairos.core.workload.workloads.parse_workload``),
    with the subcommand's default ``--duration`` (seconds). ``vllm_names``: ``--rps`` also answers to
    ``vllm bench serve``'s ``--request-rate`` (vllm/benchmarks/serve.py), so its command line's rate carries
    over, and its ``--num-prompts N`` asks for the first N requests instead of ``--duration`` seconds of
    them (``kairos bench``; :mod:`kairos.core.workload.counted`)."""
    return lambda fn: _workload_options(fn, default_duration_s, vllm_names)


def _workload_options(fn, default_duration_s: float, vllm_names: bool):
    rate_help = ("Mean request rate (requests/s). Default: the paper's Table 1 rate for generated workloads, the "
                 "trace's own timing for traces.")
    opts = [
        click.option("--workload", default="bursty", show_default=True,
                     help="bursty|lpld|lphd|hpld|hphd|azure-code|azure-conv|mooncake|trace:PATH; "
                          "a trace with ':busiest' replays its busiest --duration window."),
        click.option("--rps", type=float, default=None, help=rate_help),
    ]
    if vllm_names:  # a second option (not a second name of --rps), so an error can name the one typed
        opts.append(click.option("--request-rate", type=float, default=None,
                                 help="`vllm bench serve`'s name of --rps (give one or the other). Its 'inf' "
                                      "(send all at once) has no counterpart: requests are sent at the rate, for "
                                      "--duration or --num-prompts."))
        opts.append(click.option("--num-prompts", type=int, default=None, callback=_checked_count,
                                 help="As in `vllm bench serve`: send exactly the first N requests of the workload "
                                      f"(1 to {MAX_REQUESTS}), on its own schedule at the rate, instead of those "
                                      "of --duration seconds (give one or the other). A generated workload is "
                                      "made long enough to hold N; a trace with fewer than N is an error."))
        fn = _one_rate(fn)
    opts.append(click.option("--duration", type=float, default=default_duration_s, show_default=True,
                             help="Workload length, seconds."))
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _one_rate(fn: Callable) -> Callable:
    """Wrap a command function taking ``rps`` so that it also takes ``--request-rate`` (parameter
    ``request_rate``, popped before ``fn`` sees it): giving both is a usage error, and a rate out of
    :func:`check_workload_size`'s bounds is one naming the option given (exit 2); ``--num-prompts``
    with a ``--duration`` typed is one too (:func:`_count_or_duration`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, request_rate: float | None = None, **kwargs: Any) -> Any:
        _count_or_duration(kwargs)
        rps = kwargs.get("rps")
        if rps is not None and request_rate is not None:
            raise click.UsageError(f"--rps {rps:g} and --request-rate {request_rate:g} are the same setting "
                                   "(--request-rate is vllm bench serve's name of --rps): give one")
        if request_rate is not None:
            kwargs["rps"] = _checked_rate(request_rate, "--request-rate")
        elif rps is not None:
            _checked_rate(rps, "--rps")
        return fn(*args, **kwargs)

    return wrapper


def _checked_count(ctx, param, value: int | None) -> int | None:
    """Click callback of ``--num-prompts``: a count in :func:`check_workload_size`'s bounds, or exit 2 naming it."""
    try:
        check_workload_size(None, [], value)
    except WorkloadSizeError as exc:
        raise click.BadParameter(str(exc)) from None
    return value


def _count_or_duration(kwargs: dict[str, Any]) -> None:
    """``--num-prompts`` and a ``--duration`` given on the command line (or from the environment)
    both set the workload's length: a usage error. With ``--num-prompts`` alone, ``duration``
    becomes None (its default does not apply)."""
    n = kwargs.get("num_prompts")
    if n is None:
        return
    source = click.get_current_context().get_parameter_source("duration")
    if source not in (None, click.core.ParameterSource.DEFAULT, click.core.ParameterSource.DEFAULT_MAP):
        raise click.UsageError(f"--num-prompts {n} and --duration {kwargs['duration']:g} both set how much of the "
                               "workload is sent (the first N requests, or those arriving within so many "
                               "seconds): give one")
    kwargs["duration"] = None


def _checked_rate(rate: float, option: str) -> float:
    """``rate`` (requests/s) if :func:`check_workload_size` takes it, else a usage error naming ``option``;
    ``inf`` (``vllm bench serve``'s default, all requests at once) is explained, not just refused."""
    if math.isinf(rate) and rate > 0:
        raise click.BadParameter(
            "inf (vllm bench serve's 'send all requests at once') is not supported: kairos bench sends "
            "requests at an open-loop mean rate for --duration seconds, about rate x "
            "duration requests in all. For a burst, give a high rate over a short --duration (e.g. "
            f"{option} 1000 --duration 1: about 1000 requests within a second) and cap the requests in "
            "flight with --max-concurrency.", param_hint=option)
    try:
        check_workload_size(None, [rate])
    except WorkloadSizeError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None
    return rate


def workload_size_or_exit(duration_s: float | None, rates: list[float | None]) -> None:
    """:func:`kairos.core.workload.workloads.check_workload_size` of ``--duration`` (s) and ``--rps``.

    Raises:
        click.BadParameter: naming the option.
    """
    try:
        check_workload_size(duration_s, rates)
    except WorkloadSizeError as exc:
        raise click.BadParameter(str(exc), param_hint=size_option(exc.param)) from None


def size_option(param: str) -> str:
    """The ``kairos bench`` option of a :class:`WorkloadSizeError`'s ``param`` (``num_requests``: ``--num-prompts``)."""
    return "--num-prompts" if param == "num_requests" else f"--{param}"
