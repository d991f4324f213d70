"""Step-latency models: prefill step, decode step, mixed step and KV transfer (paper §3.3, §4.3.1, §5.2).

Where the numbers come from: a versioned JSON artifact (``kairos/core/data/profiles/*.json``) that is either a
calibration to the paper's published figures (the default ``a100-dsv2lite``) or the output of
:func:`kairos.core.model.fitting.fit_latency_model` over recorded engine steps (``kairos profile``).
Where they go: the policies (``kairos/core/policy``), the engine model (``kairos/core/engine_model``) and
the simulator. This module holds the model, its versioned artifact (``to_dict`` / ``from_dict`` /
:func:`load_profile`) and the readers of a fitted artifact's fit report (:func:`tbt_safety_beta`,
:func:`step_noise_sigma`); fitting lives in :mod:`kairos.core.model.fitting`.

All latencies are milliseconds. All token counts are tokens (not blocks). Every ``*_ms`` method
accepts Python scalars or numpy arrays of matching shape and is O(1) per element, so a dispatcher can
evaluate all decode nodes at once.

Model forms (linear in engineered features, non-negative coefficients so that every step latency is
non-decreasing in every input; the policy's closed-form chunk-run search relies on that):

* prefill step on a prefill node, ``n`` new tokens with ``c`` cached prompt tokens before the chunk::

      T_pf(n, c) = a_p + b_p·n + c_p·n·c                      (§5.2 "tokens in batch, cached KV")

* decode-only step with ``B`` running decodes holding ``K`` cached KV tokens in total::

      T0(B, K) = a_d + b_d·B + c_d·K                           (Eq. 4, first term)

* mixed step: the decode step plus a prefill chunk of ``p`` tokens whose own prompt already has
  ``c`` tokens cached on the node::

      T(B, K, p, c) = T0(B, K) + ΔT(B, K, p, c)
      ΔT = m1·p + m2·p² + m3·p·c + m4·p·K                      (Eq. 4, second term)

  The paper writes the step as ``T_step(B_n, K_n + Σχ, χ)`` (Eq. 5); we keep the decodes' KV
  (``K``) and the deflected prompt's cached tokens (``c``) as separate inputs so that the model can
  tell "attention of the chunk over its own prefix" from "decodes reading their KV". With
  ``m3 = m4`` and ``c_d`` folded in, it reduces to the paper's form.

* KV transfer of ``t`` tokens: ``setup_ms + t·bytes_per_token / bandwidth`` (§5.2, Splitwise's
  simulator). Queueing on the link is the simulator's job, not this formula's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

#: Feature names per component, in coefficient order. The artifact records them; loading checks
#: them so that an artifact fitted with another feature set fails loudly instead of mis-predicting.
PREFILL_FEATURES: tuple[str, ...] = ("n", "n*c")
DECODE_FEATURES: tuple[str, ...] = ("B", "K")
MIXED_DELTA_FEATURES: tuple[str, ...] = ("p", "p^2", "p*c", "p*K")

PROFILES_DIR = Path(__file__).resolve().parents[1] / "data" / "profiles"
DEFAULT_PROFILE = "a100-dsv2lite"


class LatencyProfileError(ValueError):
    """A latency-profile artifact is missing, malformed or uses an unsupported feature set."""


@dataclass(frozen=True)
class LinkModel:
    """KV-cache transfer link between a prefill node and a decode node.

    Attributes:
        bandwidth_gb_s: sustained payload bandwidth in GB/s (1e9 bytes per second).
        setup_ms: fixed per-transfer cost in ms (handshake, block-table exchange).
        description: where the setting comes from.
    """

    bandwidth_gb_s: float
    setup_ms: float
    description: str = ""

    def transfer_ms(self, tokens: Any, bytes_per_token: float) -> Any:
        """Transfer time in ms of ``tokens`` KV tokens (scalar or array); no link queueing."""
        return self.setup_ms + tokens * bytes_per_token / (self.bandwidth_gb_s * 1e6)


@dataclass(frozen=True)
class EngineLimits:
    """vLLM-style engine limits that belong with a hardware × model profile.

    Attributes:
        max_num_seqs: max running requests per step (vLLM ``--max-num-seqs``).
        max_num_batched_tokens: token budget per step on prefill nodes, i.e. the prefill chunk
            size χ_p of Eq. 2–3 (vLLM ``--max-num-batched-tokens``).
        decode_max_num_batched_tokens: token budget per step on decode nodes when no chunk
            schedule applies.
        kv_capacity_tokens: paged KV-cache capacity per node, in tokens.
        block_size: tokens per KV block (vLLM ``--block-size``).
        max_model_len: context window in tokens.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    decode_max_num_batched_tokens: int = 2048
    kv_capacity_tokens: int = 1_200_000
    block_size: int = 16
    max_model_len: int = 32_768

    def __post_init__(self) -> None:
        """Every limit an integer >= 1 (a profile file's ``engine`` section is checked here).

        Raises:
            ValueError: naming the field.
        """
        for name, v in vars(self).items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"engine.{name} must be an integer >= 1, got {v!r}")


@dataclass(frozen=True)
class LatencyModel:
    """Fitted step-latency model for one hardware × model pair (one artifact).

    Coefficients are in ms per unit of the named feature (see module docstring). Construct with
    :func:`load_profile`, :meth:`from_dict` or :func:`kairos.core.model.fitting.fit_latency_model`.
    """

    name: str
    version: str
    prefill_intercept_ms: float
    prefill_coef: tuple[float, float]
    decode_intercept_ms: float
    decode_coef: tuple[float, float]
    mixed_delta_coef: tuple[float, float, float, float]
    kv_bytes_per_token: float
    links: dict[str, LinkModel]
    default_link: str
    engine: EngineLimits = field(default_factory=EngineLimits)
    metadata: dict[str, Any] = field(default_factory=dict)
    mape: dict[str, float | None] = field(default_factory=dict)

    # -- evaluation (scalars or numpy arrays) --------------------------------------------------
    def prefill_step_ms(self, n_tokens: Any, cached_tokens: Any) -> Any:
        """Prefill-node step latency (ms) for ``n_tokens`` new tokens after ``cached_tokens``."""
        b, c = self.prefill_coef
        return self.prefill_intercept_ms + b * n_tokens + c * n_tokens * cached_tokens

    def decode_step_ms(self, batch_size: Any, kv_tokens: Any) -> Any:
        """Decode-only step latency T0(B, K) in ms (Eq. 4, first term)."""
        b, k = self.decode_coef
        return self.decode_intercept_ms + b * batch_size + k * kv_tokens

    def mixed_delta_ms(self, batch_size: Any, kv_tokens: Any, prefill_tokens: Any, prefill_cached: Any) -> Any:
        """ΔT_pf (ms): added latency of a ``prefill_tokens`` chunk with ``prefill_cached`` prior
        prompt tokens on a node running ``batch_size`` decodes over ``kv_tokens`` (Eq. 4)."""
        m1, m2, m3, m4 = self.mixed_delta_coef
        p = prefill_tokens
        return p * (m1 + m2 * p + m3 * prefill_cached + m4 * kv_tokens)

    def mixed_step_ms(self, batch_size: Any, kv_tokens: Any, prefill_tokens: Any, prefill_cached: Any) -> Any:
        """Mixed step latency T_step(B, K, χ) = T0 + ΔT (Eq. 4), in ms."""
        return self.decode_step_ms(batch_size, kv_tokens) + self.mixed_delta_ms(
            batch_size, kv_tokens, prefill_tokens, prefill_cached)

    def mixed_terms(self) -> tuple[float, float, float, float, float, float, float]:
        """``(a_d, b_d, c_d, m1, m2, m3, m4)``: the coefficients of :meth:`mixed_step_ms`, for hot
        loops that inline it. ``(a_d + b_d·B + c_d·K) + p·(m1 + m2·p + m3·c + m4·K)``, evaluated
        in this order, is bit-identical to ``mixed_step_ms(B, K, p, c)`` on Python floats."""
        return (self.decode_intercept_ms, *self.decode_coef, *self.mixed_delta_coef)

    def step_ms(self, batch_size: int, kv_tokens: int, prefill_tokens: int, prefill_cached: int) -> float:
        """Latency (ms) of one engine step of any composition.

        Dispatches to :meth:`prefill_step_ms` when there are no decodes, to :meth:`decode_step_ms`
        when there is no prefill work and to :meth:`mixed_step_ms` otherwise. Returns 0 for an
        empty step. ``prefill_cached`` is the cached prompt tokens of the (largest) prefill chunk.
        """
        if prefill_tokens <= 0:
            return float(self.decode_step_ms(batch_size, kv_tokens)) if batch_size > 0 else 0.0
        if batch_size <= 0:
            return float(self.prefill_step_ms(prefill_tokens, prefill_cached))
        return float(self.mixed_step_ms(batch_size, kv_tokens, prefill_tokens, prefill_cached))

    def link(self, name: str | None = None) -> LinkModel:
        """The named KV-transfer link setting (default: the profile's ``default_link``).

        Raises:
            LatencyProfileError: unknown link name.
        """
        key = name or self.default_link
        if key not in self.links:
            raise LatencyProfileError(f"unknown link {key!r}; profile {self.name!r} has {sorted(self.links)}")
        return self.links[key]

    def kv_transfer_ms(self, tokens: Any, link: str | None = None) -> Any:
        """KV-cache transfer time (ms) of ``tokens`` tokens on one link, without queueing (§5.2)."""
        return self.link(link).transfer_ms(tokens, self.kv_bytes_per_token)

    # -- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON artifact (see ``kairos/core/data/profiles/README.md``)."""
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "version": self.version,
            "units": {"latency": "ms", "tokens": "tokens", "bandwidth": "GB/s", "kv_bytes_per_token": "bytes"},
            "metadata": self.metadata,
            "prefill": {"intercept_ms": self.prefill_intercept_ms, "features": list(PREFILL_FEATURES),
                        "coef": list(self.prefill_coef), "mape_heldout": self.mape.get("prefill")},
            "decode": {"intercept_ms": self.decode_intercept_ms, "features": list(DECODE_FEATURES),
                       "coef": list(self.decode_coef), "mape_heldout": self.mape.get("decode")},
            "mixed_delta": {"features": list(MIXED_DELTA_FEATURES), "coef": list(self.mixed_delta_coef),
                            "mape_heldout": self.mape.get("mixed")},
            "kv_transfer": {
                "bytes_per_token": self.kv_bytes_per_token,
                "default_link": self.default_link,
                "links": {k: {"bandwidth_gb_s": v.bandwidth_gb_s, "setup_ms": v.setup_ms,
                              "description": v.description} for k, v in self.links.items()},
            },
            "engine": dict(self.engine.__dict__),
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> "LatencyModel":
        """Build a model from an artifact dict.

        Raises:
            LatencyProfileError: wrong schema version, missing section, feature-set mismatch, a field that is
                not a number, an engine limit below 1, kv_transfer.bytes_per_token <= 0 or a
                negative coefficient (the policy's search needs monotone models).
        """
        try:
            if doc.get("schema_version") != SCHEMA_VERSION:
                raise LatencyProfileError(f"schema_version {doc.get('schema_version')!r} unsupported "
                                          f"(want {SCHEMA_VERSION})")
            for key, feats in (("prefill", PREFILL_FEATURES), ("decode", DECODE_FEATURES),
                               ("mixed_delta", MIXED_DELTA_FEATURES)):
                got = tuple(doc[key]["features"])
                if got != feats:
                    raise LatencyProfileError(f"{key}.features is {list(got)}, this build supports {list(feats)}")
                coef = [float(x) for x in doc[key]["coef"]]
                if len(coef) != len(feats) or any(x < 0 or not math.isfinite(x) for x in coef):
                    raise LatencyProfileError(f"{key}.coef must be {len(feats)} finite non-negative numbers, "
                                              f"got {coef}")
            kv = doc["kv_transfer"]
            links = {k: LinkModel(float(v["bandwidth_gb_s"]), float(v["setup_ms"]), v.get("description", ""))
                     for k, v in kv["links"].items()}
            if kv["default_link"] not in links:
                raise LatencyProfileError(f"kv_transfer.default_link {kv['default_link']!r} not in links")
            if not (math.isfinite(float(kv["bytes_per_token"])) and float(kv["bytes_per_token"]) > 0):
                raise LatencyProfileError(f"kv_transfer.bytes_per_token must be > 0, got {kv['bytes_per_token']!r}")
            for k, v in links.items():
                if v.bandwidth_gb_s <= 0:
                    raise LatencyProfileError(f"kv_transfer.links.{k}.bandwidth_gb_s must be > 0")
            return cls(
                name=str(doc["name"]),
                version=str(doc["version"]),
                prefill_intercept_ms=float(doc["prefill"]["intercept_ms"]),
                prefill_coef=tuple(float(x) for x in doc["prefill"]["coef"]),  # type: ignore[arg-type]
                decode_intercept_ms=float(doc["decode"]["intercept_ms"]),
                decode_coef=tuple(float(x) for x in doc["decode"]["coef"]),  # type: ignore[arg-type]
                mixed_delta_coef=tuple(float(x) for x in doc["mixed_delta"]["coef"]),  # type: ignore[arg-type]
                kv_bytes_per_token=float(kv["bytes_per_token"]),
                links=links,
                default_link=str(kv["default_link"]),
                engine=EngineLimits(**doc.get("engine", {})),
                metadata=dict(doc.get("metadata", {})),
                mape={"prefill": doc["prefill"].get("mape_heldout"), "decode": doc["decode"].get("mape_heldout"),
                      "mixed": doc["mixed_delta"].get("mape_heldout")},
            )
        except KeyError as exc:
            raise LatencyProfileError(f"profile is missing field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise LatencyProfileError(f"profile has a field of the wrong type: {exc}") from None
        except ValueError as exc:  # float("x"), EngineLimits' own check
            raise LatencyProfileError(f"profile has a field with a wrong value: {exc}") from None

    @property
    def artifact_version(self) -> str:
        """``name@version``, the string recorded in decisions and traces."""
        return f"{self.name}@{self.version}"

    def save(self, path: str | Path) -> None:
        """Write the artifact as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def load_profile(name_or_path: str | Path = DEFAULT_PROFILE) -> LatencyModel:
    """Load a bundled profile by name (``a100-dsv2lite``) or an artifact from a JSON file path.

    Raises:
        LatencyProfileError: no such profile/file, invalid JSON or invalid content.
    """
    p = Path(name_or_path)
    candidates = [p] if (p.suffix == ".json" or p.exists()) else [PROFILES_DIR / f"{name_or_path}.json"]
    for c in candidates:
        if c.is_file():
            try:
                data = json.loads(c.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise LatencyProfileError(f"{c}: invalid JSON: {exc}") from None
            if not isinstance(data, dict):
                raise LatencyProfileError(f"{c}: a latency profile is a JSON object, not {type(data).__name__}")
            return LatencyModel.from_dict(data)
    bundled = sorted(x.stem for x in PROFILES_DIR.glob("*.json"))
    raise LatencyProfileError(f"no profile {str(name_or_path)!r}: not a file and not one of the bundled profiles "
                              f"{bundled}")


# ---------------------------------------------------------------------------------------------
# Readers of a fitted profile's fit report (written by kairos.core.model.fitting.fit_latency_model)
# ---------------------------------------------------------------------------------------------

#: quantiles of measured ÷ predicted over each kind's held-out steps, in the fit report
#: (``metadata.fit.heldout_ratio_quantiles``: ``{"mixed": {"p50": …, "p90": …, "p95": …, "p99": …}}``)
RATIO_QUANTILES = (0.5, 0.9, 0.95, 0.99)
#: their names in the report
RATIO_QUANTILE_NAMES = tuple(f"p{round(x * 100)}" for x in RATIO_QUANTILES)


def _ratio_quantiles(model: "LatencyModel") -> dict[str, dict[str, float]]:
    """``metadata.fit.heldout_ratio_quantiles`` of a fitted profile (``{}`` without that report)."""
    return ((model.metadata.get("fit") or {}).get("heldout_ratio_quantiles") or {})


def tbt_safety_beta(model: "LatencyModel", quantile: str = "p95") -> float:
    """β of Eq. 5 (``T ≤ β·τ``) from a fitted profile's own step noise: 1 ÷ the ``quantile`` of its
    held-out mixed steps' measured ÷ predicted time (a chunk planned at the limit then breaks τ in
    about 5 % of its steps for p95), at most 1.0, rounded down to 0.01; 1.0 for a profile without
    that report (the bundled emulated profiles, artifacts fitted before it existed).

    Raises:
        KeyError: ``quantile`` is not one of :data:`RATIO_QUANTILES` (``"p50"``, ``"p90"``, …).
    """
    if quantile not in RATIO_QUANTILE_NAMES:
        raise KeyError(f"quantile {quantile!r}: one of {list(RATIO_QUANTILE_NAMES)}")
    q = _ratio_quantiles(model).get("mixed", {}).get(quantile)
    if not isinstance(q, (int, float)) or q <= 1.0:
        return 1.0
    return math.floor(100.0 / q) / 100.0


def step_noise_sigma(model: "LatencyModel") -> float:
    """σ of the log of measured ÷ predicted step time (the multiplicative log-normal noise of
    ``kairos.sim.simulator.SimConfig.noise``) from a fitted profile's held-out quantiles: per kind
    ln(p90 ÷ p50) ÷ z₀.₉ (z₀.₉ = 1.2816, exact for a log-normal ratio), averaged over the kinds
    reported; 0.0 for a profile without that report (emulated profiles: the engine is the model)."""
    sigmas = [math.log(q["p90"] / q["p50"]) / 1.2816 for q in _ratio_quantiles(model).values()
              if isinstance(q.get("p90"), (int, float)) and isinstance(q.get("p50"), (int, float))
              and q["p50"] > 0 and q["p90"] >= q["p50"]]
    return float(sum(sigmas) / len(sigmas)) if sigmas else 0.0
