"""The policy table: one :class:`PolicySpec` per policy, carrying every trait the rest of Kairos reads.

Where it is read: :func:`kairos.core.policy.parse_policy` (names, arguments, live or simulator-only),
the dispatcher's configuration and ``kairos up``/``demo`` (live policies, deflection slots, the
node-side TBT guard), :mod:`kairos.core.cluster.routing` and the simulator (deflection slots), the
dispatcher's prefix index (prefix-aware policies), the CLI's ``--policy`` help and the policy table
of docs/policies.md (``tools/docgen/policy_table.py``). Nothing else names a policy.

Adding a policy = its module (a ``decide(spec, snapshot, model, params) -> Decision`` function or a
factory of one, e.g. :mod:`kairos.core.policy.static`) + one :class:`PolicySpec` entry in
:data:`POLICIES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from kairos.core.cluster.snapshot import ClusterSnapshot
from kairos.core.model.latency import LatencyModel
from kairos.core.policy.base import Decision, PolicyError, PolicyParams
from kairos.core.policy.kairos import decide_kairos
from kairos.core.policy.static import (DYNAMO_MAX_LOCAL_PREFILL, DYNAMO_MAX_QUEUE, decide_dynamo, decide_pd,
                                       decide_sl, decide_sq)
from kairos.core.policy.taichi import DEFAULT_DECODE_CHUNK, decide_taichi

#: ``decide(spec, snapshot, model, params) -> Decision``: a policy's pure rule (``spec`` is the string
#: it was parsed from, e.g. ``sl:1024``, recorded in the decision)
DecideFn = Callable[[str, ClusterSnapshot, LatencyModel, PolicyParams], Decision]

#: the policy parameters every run shares (α, β, τ, TTFT SLO, 𝒳, …): the CLI's defaults, the
#: dispatcher's, ``kairos up``'s and the metrics' SLOs all come from here (kairos.core.policy.base)
DEFAULT_PARAMS = PolicyParams()
#: the parameters the CLI, ``kairos up`` and the dispatcher's configuration expose (``--alpha`` …)
SHARED_PARAMS: tuple[str, ...] = ("alpha", "beta", "tbt_slo_ms", "ttft_slo_ms")
#: how docs and help write a :class:`PolicyParams` field (symbol, unit)
PARAM_SYMBOLS: dict[str, tuple[str, str]] = {
    "alpha": ("α", ""), "beta": ("β", ""), "tbt_slo_ms": ("τ", " ms"), "ttft_slo_ms": ("TTFT SLO", " ms"),
    "chunk_candidates": ("𝒳", ""), "prefill_chunk_tokens": ("χ_p", " tokens"),
    "static_chunk_tokens": ("χ", " tokens"), "flow_tpot_fraction": ("flow TPOT fraction", ""),
}
#: the policy of ``kairos decide``/``up``/``demo`` and of a dispatcher without ``KAIROS_POLICY``
DEFAULT_POLICY = "kairos"
#: deflection slots per decode node of ``kairos+`` (its projection plans each one after the others)
KAIROS_PLUS_SLOTS = 4

_WORDS = {1: "one", 2: "two", 3: "three"}


@dataclass(frozen=True)
class PolicyArg:
    """One integer argument of a policy spec (``sl:1024``'s ℓ)."""

    symbol: str  #: how the spec's usage writes it (``θ``, ``ℓ``, ``χ_D``)
    meaning: str  #: what it is, with its unit (``prompt tokens``)
    default: int | None = None  #: None: required
    example: int | None = None  #: a value the usage examples show (required arguments)

    def __post_init__(self) -> None:
        if (self.default is None) == (self.example is None):
            raise ValueError(f"policy argument {self.symbol}: give a default or (required) an example, not both")


def fixed(decide: DecideFn) -> Callable[[], DecideFn]:
    """The :attr:`PolicySpec.build` of a policy without arguments."""

    def build() -> DecideFn:
        return decide

    return build


@dataclass(frozen=True)
class PolicySpec:
    """Everything Kairos knows about one policy.

    Attributes:
        name: the spec's name (``sl`` of ``sl:1024``).
        build: called with the spec's integer arguments (defaults filled in), returns the
            :data:`DecideFn`; may raise :class:`PolicyError` for a bad value.
        description: one line: the rule.
        source: where the rule comes from (paper section, system).
        args: the integer arguments of the spec, in order.
        overrides: :class:`PolicyParams` switches this policy fixes (``kairos+`` turns its four on).
        params: the :class:`PolicyParams` fields the rule reads (docs and help show their defaults).
        live: the dispatcher can run it (``kairos up``/``demo``, compose); False: ``kairos sim`` only.
        simulator_only_why: for ``live=False``: what the node agents would have to do.
        deflection_slots: deflections a decode node holds at once (the dispatcher's
            ``max_deflections_per_node`` under ``kairos up`` and the simulator's reservation rule);
            None: no cap (deflections queue on the node; simulator only).
        node_guard: decode nodes shrink a deflected chunk whose step would exceed β·τ at the batch
            it meets (decodes that joined after the decision): ``kairos up`` sets the agents'
            ``tbt_guard_ms``, ``kairos sim``/``demo`` the simulator's ``tbt_guard``.
        reads_prefix_caches: the rule itself reads the snapshot's ``cached_prefix_tokens`` (also
            true of every policy with the ``prefix_aware`` override: :attr:`needs_prefix_index`).

    Raises:
        ValueError: an inconsistent entry (at import: the table is code).
    """

    name: str
    build: Callable[..., DecideFn]
    description: str
    source: str
    args: tuple[PolicyArg, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict, hash=False)
    params: tuple[str, ...] = ()
    live: bool = True
    simulator_only_why: str = ""
    deflection_slots: int | None = 1
    node_guard: bool = False
    reads_prefix_caches: bool = False

    def __post_init__(self) -> None:
        fields = set(PolicyParams.__struct_fields__)
        bad = sorted((set(self.overrides) | set(self.params)) - fields)
        if bad:
            raise ValueError(f"policy {self.name}: {bad} are not PolicyParams fields")
        if not self.name or any(c in self.name for c in ":, ") or "\n" in self.description:
            raise ValueError(f"policy {self.name!r}: a name without ':', ',' or spaces and a one-line description")
        if self.live and (self.deflection_slots is None or self.deflection_slots < 1):
            raise ValueError(f"policy {self.name}: a live policy needs deflection_slots >= 1 (the dispatcher's cap)")
        if self.live == bool(self.simulator_only_why):
            raise ValueError(f"policy {self.name}: simulator_only_why is for (and required by) live=False")
        if self.overrides.get("flowing_decode") and self.live:
            raise ValueError(f"policy {self.name}: flowing decode runs in the simulator only (live=False)")
        required = [a.default is None for a in self.args]
        if required != sorted(required, reverse=True):
            raise ValueError(f"policy {self.name}: required arguments come before optional ones")

    @property
    def usage(self) -> str:
        """``sq:θ``, ``dynamo[:L[:Q]]``: the spec's form."""
        out, optional = self.name, 0
        for a in self.args:
            if a.default is None:
                out += f":{a.symbol}"
            else:
                out, optional = out + f"[:{a.symbol}", optional + 1
        return out + "]" * optional

    @property
    def example(self) -> str:
        """A valid spec (``sq:1``, ``sl:1024``, ``dynamo``)."""
        return ":".join([self.name, *(str(a.example) for a in self.args if a.default is None)])

    @property
    def needs_prefix_index(self) -> bool:
        """Decisions read the nodes' prefix caches: the dispatcher keeps a prefix index of them."""
        return self.reads_prefix_caches or bool(self.overrides.get("prefix_aware"))

    def defaults(self, params: PolicyParams = DEFAULT_PARAMS) -> dict[str, Any]:
        """:attr:`params` → value in ``params`` with :attr:`overrides` applied (the policy's defaults)."""
        pp = msgspec.structs.replace(params, **self.overrides) if self.overrides else params
        return {p: getattr(pp, p) for p in self.params}

    def decide_fn(self, args: list[int]) -> DecideFn:
        """The rule for the spec's integer ``args`` (the optional ones' defaults filled in).

        Raises:
            PolicyError: too many or too few arguments, or :attr:`build` refused a value.
        """
        need = sum(1 for a in self.args if a.default is None)
        what = ", ".join(f"{a.symbol} = {a.meaning}" for a in self.args)
        if not self.args and args:
            raise PolicyError("takes no argument")
        if need == len(self.args) and len(args) != need:
            raise PolicyError(f"needs exactly {_WORDS.get(need, need)} argument{'s' * (need > 1)} ({what})")
        if len(args) > len(self.args):
            n = len(self.args)
            raise PolicyError(f"takes at most {_WORDS.get(n, n)} argument{'s' * (n > 1)} ({what})")
        if len(args) < need:
            raise PolicyError(f"needs at least {_WORDS.get(need, need)} argument{'s' * (need > 1)} ({what})")
        return self.build(*args, *(a.default for a in self.args[len(args):]))


_KAIROS_PARAMS = ("alpha", "beta", "tbt_slo_ms", "ttft_slo_ms", "chunk_candidates", "prefill_chunk_tokens")

#: name → spec, in the order docs and help list them. Register a policy here (one entry).
POLICIES: dict[str, PolicySpec] = {s.name: s for s in (
    PolicySpec("pd", fixed(decide_pd), "never deflect (DistServe-style P/D)", "paper §3.4, §6.1.2"),
    PolicySpec("sq", decide_sq, "deflect when **every** prefill node's queue holds more than θ requests",
               "§3.4", args=(PolicyArg("θ", "prefill queue length", example=1),),
               params=("static_chunk_tokens",)),
    PolicySpec("sl", decide_sl, "deflect every request whose prompt is shorter than ℓ tokens", "§3.4",
               args=(PolicyArg("ℓ", "prompt tokens", example=1024),), params=("static_chunk_tokens",)),
    PolicySpec("dynamo", decide_dynamo,
               "the decode worker is the one holding the request's longest cached prefix; remote prefill iff the "
               "*uncached* prompt ℓ − hit > L and the prefill queue holds < Q requests, else local prefill of the "
               "uncached tokens on that worker",
               "NVIDIA Dynamo's conditional disaggregation (`DisaggregatedRouter.prefill_remote(prefill_length, "
               "prefix_hit_length)`: `prefill_length − prefix_hit_length > max_local_prefill_length`, and the "
               "worker's `queue_size < max_prefill_queue_size`)",
               args=(PolicyArg("L", "max local prefill tokens", DYNAMO_MAX_LOCAL_PREFILL),
                     PolicyArg("Q", "prefill queue size", DYNAMO_MAX_QUEUE)),
               reads_prefix_caches=True),
    PolicySpec("kairos", fixed(decide_kairos),
               "Algorithm 1 with Eq. 1–7, one in-flight deflection per decode node", "§4", params=_KAIROS_PARAMS),
    PolicySpec("kairos+", fixed(decide_kairos),
               "`kairos` + KV-transfer-aware TTFT_pf + projected decode state (several deflections per node) + "
               "learned model correction (`model_correction`, below) + cache-aware Eq. 1–6 (`prefix_aware`, below)",
               "§7 future work; docs/policies.md",
               overrides={"kv_transfer_aware": True, "project_decode_state": True, "model_correction": True,
                          "prefix_aware": True},
               params=_KAIROS_PARAMS, deflection_slots=KAIROS_PLUS_SLOTS, node_guard=True),
    PolicySpec("taichi", decide_taichi,
               "TaiChi baseline: prefill-heavy/decode-heavy instances, length-aware prefill scheduling, flowing "
               "decode (below; L = 0: no length cap)", "Wang et al., 2025; paper §6",
               args=(PolicyArg("χ_D", "decode-heavy chunk tokens", DEFAULT_DECODE_CHUNK),
                     PolicyArg("L", "max prompt tokens on decode-heavy", 0)),
               overrides={"flowing_decode": True},
               params=("ttft_slo_ms", "tbt_slo_ms", "prefill_chunk_tokens", "flow_tpot_fraction"), live=False,
               simulator_only_why="its prefill-heavy nodes decode and hand running decodes over (flowing decode), "
                                  "which the node agents do not do",
               deflection_slots=None),
)}


def policy_spec(spec: str) -> PolicySpec:
    """The table entry of a spec string (``sl:1024`` → ``sl``'s); arguments are not checked here.

    Raises:
        PolicyError: unknown name (the message lists the known ones).
    """
    name = spec.strip().split(":", 1)[0]
    try:
        return POLICIES[name]
    except KeyError:
        raise PolicyError(f"unknown policy {spec!r}; known: {', '.join(sorted(POLICIES))}") from None


def policy_specs(live: bool = False) -> list[PolicySpec]:
    """The registered policies in table order; ``live``: only those the dispatcher can run."""
    return [s for s in POLICIES.values() if s.live or not live]


def policy_help(live: bool = False) -> str:
    """The ``--policy`` help of the CLI: every policy's form, the simulator-only ones named apart
    when ``live``."""
    text = ", ".join(s.usage for s in policy_specs(live))
    sim_only = [s.usage for s in POLICIES.values() if not s.live]
    if live and sim_only:
        text += f" ({', '.join(sim_only)}: simulator only)"
    return text + "."


def node_guard_policies() -> list[str]:
    """Names of the policies whose decode nodes run the TBT guard (``--tbt-guard`` help)."""
    return [s.name for s in POLICIES.values() if s.node_guard]
