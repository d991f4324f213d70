"""The ``kairos`` command line: one thin function per subcommand over ``shared/``.

stdout carries results (JSON or tables), stderr carries messages; bad input exits with code 2.
"""

from __future__ import annotations

import sys

import click

from shared.latency import DEFAULT_PROFILE, LatencyModel, ProfileError, load_profile
from shared.policy import PolicyError, PolicyParams, parse_policy


def load_model_or_exit(profile: str) -> LatencyModel:
    """Load a profile by name or path, or exit 2 with the reason."""
    try:
        return load_profile(profile)
    except ProfileError as exc:
        raise click.BadParameter(str(exc), param_hint="--profile") from None


def policy_params_options(fn):
    """Shared options for α, β, τ and the TTFT SLO (one PolicyParams for every subcommand)."""
    opts = [
        click.option("--alpha", type=float, default=1.3, show_default=True, help="α ≥ 1, Eq. 7 TTFT margin."),
        click.option("--beta", type=float, default=1.0, show_default=True, help="β, TBT safety factor (Eq. 5)."),
        click.option("--tbt-slo-ms", type=float, default=70.0, show_default=True, help="τ, TBT SLO in ms."),
        click.option("--ttft-slo-ms", type=float, default=4000.0, show_default=True, help="TTFT SLO in ms."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def make_params(alpha: float, beta: float, tbt_slo_ms: float, ttft_slo_ms: float, **extra) -> PolicyParams:
    """Build PolicyParams or exit 2 naming the bad value."""
    try:
        return PolicyParams(alpha=alpha, beta=beta, tbt_slo_ms=tbt_slo_ms, ttft_slo_ms=ttft_slo_ms, **extra)
    except PolicyError as exc:
        raise click.UsageError(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kairos")
def main() -> None:
    """Kairos: load-aware prefill deflection for P/D-disaggregated LLM serving."""


@main.command()
@click.argument("snapshot", type=click.File("rb"), default="-")
@click.option("--policy", default="kairos", show_default=True, help="pd, sq:θ, sl:ℓ, dynamo, kairos, kairos+.")
@click.option("--profile", default=DEFAULT_PROFILE, show_default=True, help="Bundled profile name or artifact path.")
@policy_params_options
def decide(snapshot, policy: str, profile: str, **params) -> None:
    """Print one routing decision (JSON) for a cluster SNAPSHOT (file or - for stdin)."""
    import msgspec

    from shared.snapshot import SnapshotError, parse_snapshot

    pol = _parse_policy_or_exit(policy)
    model = load_model_or_exit(profile)
    pp = make_params(**params)
    try:
        snap = parse_snapshot(snapshot.read())
    except SnapshotError as exc:
        click.echo(f"kairos decide: {exc}", err=True)
        sys.exit(2)
    decision = pol.decide(snap, model, pp)
    click.echo(msgspec.json.format(msgspec.json.encode(decision), indent=2))


def _parse_policy_or_exit(spec: str):
    try:
        return parse_policy(spec)
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint="--policy") from None


if __name__ == "__main__":  # pragma: no cover
    main()
