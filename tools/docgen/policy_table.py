"""The ``policy-table`` block of docs/policies.md: the policy table rendered from
:data:`kairos.core.policy.registry.POLICIES` (each spec's form, rule, traits, arguments and parameter
defaults, source), so the docs list exactly the registered policies with the traits the code uses."""

from __future__ import annotations

from typing import Any

from kairos.core.policy.registry import PARAM_SYMBOLS, POLICIES, PolicySpec


def _value(v: Any) -> str:
    """A parameter value as the docs write it: ``1,000``, ``1.3``, ``{2048, 1024}``."""
    if isinstance(v, tuple):
        return "{" + ", ".join(str(x) for x in v) + "}"
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _parameters(spec: PolicySpec) -> str:
    """The spec's integer arguments (required, or their default) and the PolicyParams fields its
    rule reads with their defaults; the switches it turns on."""
    parts = [f"{a.symbol}: {a.meaning}" + (" (required)" if a.default is None else f", default {_value(a.default)}")
             for a in spec.args]
    for name, v in spec.defaults().items():
        symbol, unit = PARAM_SYMBOLS.get(name, (f"`{name}`", ""))
        parts.append(f"{symbol} = {_value(v)}{unit}")
    parts += [f"`{k}` on" for k, v in spec.overrides.items() if v is True]
    return "; ".join(parts) or "–"


def policy_table(load: Any = None) -> str:
    """Markdown table of every registered policy, in table order.

    ``load`` (the result loader every renderer takes) is unused: the source is the code itself.
    """
    lines = ["| spec | rule | live | deflection slots per decode node | node-side TBT guard | reads prefix caches "
             "| arguments and parameters (defaults) | source |",
             "|---|---|---|---|---|---|---|---|"]
    for s in POLICIES.values():
        live = "yes" if s.live else "simulator only"
        slots = "no cap" if s.deflection_slots is None else str(s.deflection_slots)
        lines.append(f"| `{s.usage}` | {s.description} | {live} | {slots} | {'yes' if s.node_guard else 'no'} "
                     f"| {'yes' if s.needs_prefix_index else 'no'} | {_parameters(s)} | {s.source} |")
    return "\n".join(lines)
