"""Deflection policies: one interface for dispatcher, simulator and ``kairos decide``.

A decision is a value computed by a pure function::

    policy = parse_policy("kairos")            # or "pd", "sq:1", "sl:1024", "dynamo", "kairos+"
    decision = policy.decide(snapshot, model, params)

Every policy and its traits (arguments, live or simulator-only, deflection slots, node guard,
prefix caches, parameters) are one entry of :data:`kairos.core.policy.registry.POLICIES`: adding a
policy = one module + one entry there. Infeasibility is data in the decision (``reason``, ``None``
estimates), never a log line; reservations, retries and I/O belong to the dispatcher shell.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kairos.core.cluster.snapshot import ClusterSnapshot
from kairos.core.model.latency import LatencyModel
from kairos.core.policy.base import DEFAULT_CANDIDATES, Decision, PolicyError, PolicyParams
from kairos.core.policy.registry import (DEFAULT_PARAMS, DEFAULT_POLICY, POLICIES, DecideFn, PolicySpec,
                                         policy_specs)


@dataclass(frozen=True)
class Policy:
    """A parsed policy spec. ``decide`` is pure: same inputs, same :class:`Decision`."""

    spec: str  #: the spec string (``sl:1024``), recorded in every decision
    traits: PolicySpec  #: the policy's table entry
    fn: DecideFn

    @property
    def name(self) -> str:
        """The policy's name (``sl`` of ``sl:1024``)."""
        return self.traits.name

    @property
    def overrides(self) -> dict:
        """The :class:`PolicyParams` switches the policy fixes (``kairos+``: its four features)."""
        return self.traits.overrides

    def params(self, params: PolicyParams) -> PolicyParams:
        """``params`` with this policy's fixed switches applied (kairos+ turns its features on)."""
        return msgspec.structs.replace(params, **self.overrides) if self.overrides else params

    def uses_prefix_caches(self, params: PolicyParams) -> bool:
        """True when decisions read the snapshot's ``cached_prefix_tokens`` (the spec's
        :attr:`~PolicySpec.needs_prefix_index`, or ``prefix_aware`` set in ``params``): the
        dispatcher then keeps a prefix index of the nodes' caches."""
        return self.traits.needs_prefix_index or self.params(params).prefix_aware

    def decide(self, snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams) -> Decision:
        """Route ``snap.request`` (see the policy modules for each rule)."""
        return self.fn(self.spec, snap, model, self.params(params))


def parse_policy(spec: str, live: bool = False) -> Policy:
    """Parse ``name[:arg[:arg]]`` (``sl:1024``, ``sq:1``, ``dynamo:1000:2``, ``kairos``).

    ``live``: for the dispatcher (``kairos up``/``demo``, compose), which refuses the policies whose
    spec is not :attr:`~PolicySpec.live` and leaves them out of the known ones.

    Raises:
        PolicyError: unknown name, bad arguments or (``live``) a simulator-only policy; the message
            lists the known policies.
    """
    name, *raw = spec.strip().split(":")
    known = ", ".join(sorted(s.name for s in policy_specs(live)))
    if name not in POLICIES:
        raise PolicyError(f"unknown policy {spec!r}; known: {known} "
                          f"(e.g. {', '.join(s.example for s in policy_specs(live))})")
    entry = POLICIES[name]
    if live and not entry.live:
        raise PolicyError(f"{spec!r} is a simulator baseline: {entry.simulator_only_why}; run it with "
                          f"`kairos sim --policy {spec}` (live policies: {known})")
    try:
        args = [int(a) for a in raw]
    except ValueError:
        raise PolicyError(f"policy {spec!r}: arguments must be integers") from None
    if any(a < 0 for a in args):
        raise PolicyError(f"policy {spec!r}: arguments must be >= 0")
    try:
        fn = entry.decide_fn(args)
    except PolicyError as exc:
        raise PolicyError(f"policy {spec!r}: {exc}") from None
    return Policy(spec=spec.strip(), traits=entry, fn=fn)


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
    return pol.decide(snap, model, params or DEFAULT_PARAMS)


__all__ = ["Decision", "PolicyParams", "PolicyError", "Policy", "PolicySpec", "POLICIES", "DEFAULT_PARAMS",
           "DEFAULT_POLICY", "parse_policy", "parse_policies", "decide", "DEFAULT_CANDIDATES"]
