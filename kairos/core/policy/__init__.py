"""Deflection policies: one interface for dispatcher, simulator and ``kairos decide``.

A decision is a value computed by a pure function::

    policy = parse_policy("kairos")            # or "pd", "sq:1", "sl:1024", "dynamo", "kairos+"
    decision = policy.decide(snapshot, model, params)

Adding a policy = one module + one line in :data:`POLICIES`. Infeasibility is data in the
decision (``reason``, ``None`` estimates), never a log line; reservations, retries and I/O belong
to the dispatcher shell.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import msgspec

from kairos.core.model.latency import LatencyModel
from kairos.core.policy.base import DEFAULT_CANDIDATES, Decision, PolicyError, PolicyParams
from kairos.core.policy.kairos import decide_kairos
from kairos.core.policy.static import decide_dynamo, decide_pd, decide_sl, decide_sq
from kairos.core.policy.taichi import decide_taichi
from kairos.core.cluster.snapshot import ClusterSnapshot

DecideFn = Callable[[str, ClusterSnapshot, LatencyModel, PolicyParams], Decision]


def _no_arg(fn: DecideFn) -> Callable[[list[int]], DecideFn]:
    def build(args: list[int]) -> DecideFn:
        if args:
            raise PolicyError("takes no argument")
        return fn
    return build


def _one_arg(factory: Callable[[int], DecideFn], what: str) -> Callable[[list[int]], DecideFn]:
    def build(args: list[int]) -> DecideFn:
        if len(args) != 1:
            raise PolicyError(f"needs exactly one argument ({what})")
        return factory(args[0])
    return build


def _taichi(args: list[int]) -> DecideFn:
    if len(args) > 2:
        raise PolicyError("takes at most two arguments (decode-heavy chunk tokens, max prompt tokens on decode-heavy)")
    return decide_taichi(*args)


def _dynamo(args: list[int]) -> DecideFn:
    if len(args) > 2:
        raise PolicyError("takes at most two arguments (max local prefill tokens, prefill queue size)")
    return decide_dynamo(*args)


#: policy name → (builder from integer arguments, params overrides, one-line description)
POLICIES: dict[str, tuple[Callable[[list[int]], DecideFn], dict, str]] = {
    "pd": (_no_arg(decide_pd), {}, "P/D disaggregation, never deflect (DistServe baseline)"),
    "sq": (_one_arg(decide_sq, "θ, prefill queue length"), {}, "deflect when every prefill queue > θ, χ=128 (§3.4)"),
    "sl": (_one_arg(decide_sl, "ℓ, prompt tokens"), {}, "deflect prompts shorter than ℓ tokens, χ=128 (§3.4)"),
    "dynamo": (_dynamo, {}, "local prefill if uncached prompt ≤ 1000 or prefill queue ≥ 2 (Dynamo, prefix-aware)"),
    "kairos": (_no_arg(decide_kairos), {}, "Algorithm 1, Eq. 1-7, one in-flight deflection per decode node"),
    "kairos+": (_no_arg(decide_kairos), {"kv_transfer_aware": True, "project_decode_state": True,
                                         "model_correction": True, "prefix_aware": True},
                "kairos + KV-transfer-aware TTFT_pf + projected decode state + learned model correction"
                " + cache-aware Eq. 1-6"),
    "taichi": (_taichi, {"flowing_decode": True},
               "TaiChi baseline: P-heavy/D-heavy instances, length-aware prefill, flowing decode (simulator)"),
}


@dataclass(frozen=True)
class Policy:
    """A parsed policy spec. ``decide`` is pure: same inputs, same :class:`Decision`."""

    spec: str
    name: str
    fn: DecideFn
    overrides: dict

    def params(self, params: PolicyParams) -> PolicyParams:
        """``params`` with this policy's fixed switches applied (kairos+ turns its features on)."""
        return msgspec.structs.replace(params, **self.overrides) if self.overrides else params

    def uses_prefix_caches(self, params: PolicyParams) -> bool:
        """True when decisions read the snapshot's ``cached_prefix_tokens`` (kairos+, dynamo, or
        ``prefix_aware`` set): the dispatcher then keeps a prefix index of the nodes' caches."""
        return self.name == "dynamo" or self.params(params).prefix_aware

    def decide(self, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
        """Route ``snap.request`` (see the policy modules for each rule)."""
        return self.fn(self.spec, snap, model, self.params(params))


def simulator_only(name: str) -> bool:
    """True for a policy the live stack cannot run (``taichi``: its prefill-heavy nodes hand running
    decodes over — flowing decode — which the node agents do not do); ``kairos sim`` runs it."""
    return bool(POLICIES[name][1].get("flowing_decode"))


def parse_policy(spec: str, live: bool = False) -> Policy:
    """Parse ``name[:arg[:arg]]`` (``sl:1024``, ``sq:1``, ``dynamo:1000:2``, ``kairos``).

    ``live``: for the dispatcher (``kairos up``/``demo``, compose), which refuses the
    :func:`simulator_only` policies and leaves them out of the known ones.

    Raises:
        PolicyError: unknown name, bad arguments or (``live``) a simulator-only policy; the message
            lists the known policies.
    """
    name, *raw = spec.strip().split(":")
    known = sorted(n for n in POLICIES if not (live and simulator_only(n)))
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {spec!r}; known: {', '.join(known)} "
                          f"(e.g. pd, sq:1, sl:1024, dynamo, kairos, kairos+{'' if live else ', taichi'})")
    if live and simulator_only(name):
        raise PolicyError(f"{spec!r} is a simulator baseline: its prefill-heavy nodes decode and hand running decodes "
                          f"over (flowing decode), which the node agents do not do; run it with "
                          f"`kairos sim --policy {spec}` (live policies: {', '.join(known)})")
    try:
        args = [int(a) for a in raw]
    except ValueError:
        raise PolicyError(f"policy {spec!r}: arguments must be integers") from None
    if any(a < 0 for a in args):
        raise PolicyError(f"policy {spec!r}: arguments must be >= 0")
    builder, overrides, _ = POLICIES[name]
    try:
        fn = builder(args)
    except PolicyError as exc:
        raise PolicyError(f"policy {spec!r}: {exc}") from None
    return Policy(spec=spec.strip(), name=name, fn=fn, overrides=overrides)


def parse_policies(specs: str) -> list[Policy]:
    """Parse a comma-separated list (``pd,sq:1,kairos``)."""
    out = [parse_policy(s) for s in specs.split(",") if s.strip()]
    if not out:
        raise PolicyError("no policy given")
    return out


def decide(policy: str | Policy, snap: ClusterSnapshot, model: LatencyModel,
           params: PolicyParams | None = None) -> Decision:
    """Convenience: parse (if needed) and decide."""
    pol = parse_policy(policy) if isinstance(policy, str) else policy
    return pol.decide(snap, model, params or PolicyParams())


__all__ = ["Decision", "PolicyParams", "PolicyError", "Policy", "POLICIES", "parse_policy", "parse_policies", "simulator_only",
           "decide", "DEFAULT_CANDIDATES"]
