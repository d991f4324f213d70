"""Step-latency models: prefill step, decode step, mixed step and KV transfer (paper §3.3, §4.3.1, §5.2).

Where the numbers come from: a versioned JSON artifact (``kairos/core/data/profiles/*.json``) that is either a
calibration to the paper's published figures (the default ``a100-dsv2lite``) or the output of
:func:`fit_latency_model` over recorded engine steps (``kairos profile``). Where they go: the
policies (``kairos/core/policy``), the engine model (``kairos/core/engine``) and the simulator.

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
from typing import Any, Sequence

import numpy as np

SCHEMA_VERSION = 1

#: Feature names per component, in coefficient order. The artifact records them; loading checks
#: them so that an artifact fitted with another feature set fails loudly instead of mis-predicting.
PREFILL_FEATURES: tuple[str, ...] = ("n", "n*c")
DECODE_FEATURES: tuple[str, ...] = ("B", "K")
MIXED_DELTA_FEATURES: tuple[str, ...] = ("p", "p^2", "p*c", "p*K")

PROFILES_DIR = Path(__file__).resolve().parents[1] / "data" / "profiles"
DEFAULT_PROFILE = "a100-dsv2lite"


class ProfileError(ValueError):
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


@dataclass(frozen=True)
class LatencyModel:
    """Fitted step-latency model for one hardware × model pair (one artifact).

    Coefficients are in ms per unit of the named feature (see module docstring). Construct with
    :func:`load_profile`, :meth:`from_dict` or :func:`fit_latency_model`.
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
            ProfileError: unknown link name.
        """
        key = name or self.default_link
        if key not in self.links:
            raise ProfileError(f"unknown link {key!r}; profile {self.name!r} has {sorted(self.links)}")
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
            ProfileError: wrong schema version, missing section, feature-set mismatch or a
                negative coefficient (the policy's search needs monotone models).
        """
        try:
            if doc.get("schema_version") != SCHEMA_VERSION:
                raise ProfileError(f"schema_version {doc.get('schema_version')!r} unsupported (want {SCHEMA_VERSION})")
            for key, feats in (("prefill", PREFILL_FEATURES), ("decode", DECODE_FEATURES),
                               ("mixed_delta", MIXED_DELTA_FEATURES)):
                got = tuple(doc[key]["features"])
                if got != feats:
                    raise ProfileError(f"{key}.features is {list(got)}, this build supports {list(feats)}")
                coef = [float(x) for x in doc[key]["coef"]]
                if len(coef) != len(feats) or any(x < 0 or not math.isfinite(x) for x in coef):
                    raise ProfileError(f"{key}.coef must be {len(feats)} finite non-negative numbers, got {coef}")
            kv = doc["kv_transfer"]
            links = {k: LinkModel(float(v["bandwidth_gb_s"]), float(v["setup_ms"]), v.get("description", ""))
                     for k, v in kv["links"].items()}
            if kv["default_link"] not in links:
                raise ProfileError(f"kv_transfer.default_link {kv['default_link']!r} not in links")
            for k, v in links.items():
                if v.bandwidth_gb_s <= 0:
                    raise ProfileError(f"kv_transfer.links.{k}.bandwidth_gb_s must be > 0")
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
            raise ProfileError(f"profile is missing field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ProfileError(f"profile has a field of the wrong type: {exc}") from None

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
        ProfileError: no such profile/file, invalid JSON or invalid content.
    """
    p = Path(name_or_path)
    candidates = [p] if (p.suffix == ".json" or p.exists()) else [PROFILES_DIR / f"{name_or_path}.json"]
    for c in candidates:
        if c.is_file():
            try:
                return LatencyModel.from_dict(json.loads(c.read_text()))
            except json.JSONDecodeError as exc:
                raise ProfileError(f"{c}: invalid JSON: {exc}") from None
    bundled = sorted(x.stem for x in PROFILES_DIR.glob("*.json"))
    raise ProfileError(f"no profile {str(name_or_path)!r}: not a file and not one of the bundled profiles {bundled}")


# ---------------------------------------------------------------------------------------------
# Fitting from step records (§5.1–5.2): scikit-learn linear regression on the features above.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepRecord:
    """One engine step as recorded by the profiler or the emulated engine.

    Attributes:
        batch_size: running decode requests in the step (B; one token each).
        kv_tokens: cached KV tokens of those decodes, summed (K).
        prefill_tokens: new prompt tokens scheduled in the step (n or p; 0 for decode-only).
        prefill_cached: prompt tokens of the prefilling request(s) already cached before the step.
        latency_ms: measured wall time of the step in ms.
    """

    batch_size: int
    kv_tokens: int
    prefill_tokens: int
    prefill_cached: int
    latency_ms: float


def mape(y_true: Sequence[float] | np.ndarray, y_pred: Sequence[float] | np.ndarray) -> float:
    """Mean absolute percentage error in percent (sklearn's ``mean_absolute_percentage_error`` × 100)."""
    from sklearn.metrics import mean_absolute_percentage_error

    return float(mean_absolute_percentage_error(np.asarray(y_true, float), np.asarray(y_pred, float)) * 100.0)


class FitRefused(ValueError):
    """A fit's held-out MAPE exceeds the threshold: the artifact must not be published.

    Attributes:
        model: the refused model (with its MAPE and fit report in ``metadata["fit"]``).
    """

    def __init__(self, message: str, model: "LatencyModel") -> None:
        super().__init__(message)
        self.model = model


#: Outlier rule (stated, issue 9 item 2): within one kind, a sample whose log-residual from a first
#: fit lies more than this many robust standard deviations (1.4826 × MAD) from the median
#: log-residual is rejected, then the kind is refitted without it — Iglewicz and Hoaglin's
#: modified z-score |0.6745 (x − median) / MAD| > 3.5. Measured step times have a one-sided tail
#: (a late wake-up, a preempted CPU, a GC pause), which this trims.
OUTLIER_ROBUST_SIGMAS = 3.5
#: Grid regions for the per-region held-out MAPE: token-count buckets (n or p) and batch buckets (B).
TOKEN_REGIONS: tuple[int, ...] = (256, 1024)
BATCH_REGIONS: tuple[int, ...] = (8, 64)


def _bucket(v: float, edges: tuple[int, ...], unit: str) -> str:
    lo = 0
    for e in edges:
        if v <= e:
            return f"{unit}≤{e}" if lo == 0 else f"{lo}<{unit}≤{e}"
        lo = e
    return f"{unit}>{lo}"


def _region(kind: str, B: float, p: float) -> str:
    """Grid region of a step: prefill by new tokens n, decode by batch B, mixed by chunk p and B."""
    if kind == "prefill":
        return _bucket(p, TOKEN_REGIONS, "n")
    if kind == "decode":
        return _bucket(B, BATCH_REGIONS, "B")
    return f"{_bucket(p, TOKEN_REGIONS, 'p')}, {_bucket(B, BATCH_REGIONS, 'B')}"


def _split(n: int, holdout: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.model_selection import train_test_split

    idx = np.arange(n)
    if n < 5:
        raise ValueError(f"need at least 5 step records of each kind to fit and hold out, got {n}")
    return tuple(train_test_split(idx, test_size=holdout, random_state=seed))  # type: ignore[return-value]


def _outliers(y: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """Mask of samples outside OUTLIER_ROBUST_SIGMAS robust σ of the median log-residual."""
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.log(y / np.maximum(pred, 1e-9))
    med = np.median(x)
    mad = 1.4826 * np.median(np.abs(x - med))
    if not mad > 0:
        return np.zeros(len(y), dtype=bool)
    return np.abs(x - med) > OUTLIER_ROBUST_SIGMAS * mad


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


def fit_latency_model(
    records: Sequence[StepRecord],
    *,
    name: str,
    version: str,
    base: LatencyModel | None = None,
    holdout: float = 0.2,
    seed: int = 0,
    metadata: dict[str, Any] | None = None,
    max_mape: float | None = None,
) -> LatencyModel:
    """Fit the three step-latency components from step records and report held-out MAPE.

    Records are split by composition: prefill-only (``batch_size == 0``), decode-only
    (``prefill_tokens == 0``) and mixed. Each component is an sklearn ``LinearRegression`` with
    ``positive=True`` on the features of the module docstring. The mixed component is fitted on the
    residual ``latency − T0(B, K)`` of the fitted decode model (§5.2: "sum of pure decode step
    latency and additional prefill time"). A random ``holdout`` fraction of each kind is kept out
    of fitting; the reported MAPE (percent) is on those rows only.

    Fit hygiene (recorded in ``metadata["fit"]``): records with a non-finite or non-positive
    latency, negative token counts or an empty step are rejected (``rejected.invalid``); within each
    kind, training rows that are outliers by :data:`OUTLIER_ROBUST_SIGMAS` after a first fit are
    rejected (``rejected.outlier``) and the kind is refitted. Held-out rows are never filtered, so
    the MAPE is not flattered. ``metadata["fit"]["mape_regions"]`` has the held-out MAPE per grid
    region (:func:`_region`).

    Args:
        records: step records (at least 5 valid ones of each kind).
        name, version: artifact identity.
        base: model whose KV-transfer links and engine limits are carried over (default: the
            bundled default profile).
        metadata: recorded as the artifact's ``metadata`` (hardware, model, source...).
        max_mape: refuse the fit when any component's held-out MAPE (percent) exceeds this.

    Raises:
        ValueError: too few valid records of a kind.
        FitRefused: a held-out MAPE above ``max_mape`` (the exception carries the model).
    """
    from sklearn.linear_model import LinearRegression

    base = base or load_profile(DEFAULT_PROFILE)
    arr = np.array([(r.batch_size, r.kv_tokens, r.prefill_tokens, r.prefill_cached, r.latency_ms) for r in records],
                   dtype=float).reshape(-1, 5)
    with np.errstate(invalid="ignore"):
        valid = (np.isfinite(arr).all(axis=1) & (arr[:, 4] > 0) & (arr[:, :4] >= 0).all(axis=1)
                 & ((arr[:, 0] > 0) | (arr[:, 2] > 0)))
    rejected = {"invalid": int((~valid).sum()), "outlier": 0}
    B, K, p, c, y = arr[valid].T
    is_pf, is_dec = B == 0, p == 0
    is_mix = ~is_pf & ~is_dec
    result: dict[str, Any] = {}
    mapes: dict[str, float | None] = {}
    regions: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    quantiles: dict[str, dict[str, float]] = {}

    def fit_kind(kind: str, X: np.ndarray, target: np.ndarray, offset: np.ndarray, intercept: bool):
        """Fit one kind (target = y − offset), reject outliers, report held-out MAPE on y."""
        tr, te = _split(len(X), holdout, seed)
        reg = LinearRegression(positive=True, fit_intercept=intercept).fit(X[tr], target[tr])
        out = _outliers(target[tr] + offset[tr], reg.predict(X[tr]) + offset[tr])
        if out.any():
            rejected["outlier"] += int(out.sum())
            keep = tr[~out]
            if len(keep) < 3:
                raise ValueError(f"too few {kind} records left after rejecting outliers")
            reg = LinearRegression(positive=True, fit_intercept=intercept).fit(X[keep], target[keep])
        truth, pred = target[te] + offset[te], reg.predict(X[te]) + offset[te]
        mapes[kind] = mape(truth, pred)
        counts[kind] = len(X)
        ok = pred > 0
        if ok.any():
            q = np.quantile(truth[ok] / pred[ok], RATIO_QUANTILES)
            quantiles[kind] = {name: round(float(v), 4) for name, v in zip(RATIO_QUANTILE_NAMES, q)}
        return reg, te, truth, pred

    # prefill-only
    X = np.column_stack([p, p * c])[is_pf]
    reg, te, t_, p_ = fit_kind("prefill", X, y[is_pf], np.zeros(len(X)), True)
    result["prefill"] = (max(float(reg.intercept_), 0.0), tuple(float(v) for v in reg.coef_))
    _regions(regions, "prefill", B[is_pf][te], p[is_pf][te], t_, p_)

    # decode-only
    X = np.column_stack([B, K])[is_dec]
    reg_d, te, t_, p_ = fit_kind("decode", X, y[is_dec], np.zeros(len(X)), True)
    result["decode"] = (max(float(reg_d.intercept_), 0.0), tuple(float(v) for v in reg_d.coef_))
    _regions(regions, "decode", B[is_dec][te], p[is_dec][te], t_, p_)

    # mixed: residual over the decode model, no intercept (ΔT(p=0) = 0)
    pm, cm, Km, Bm, ym = p[is_mix], c[is_mix], K[is_mix], B[is_mix], y[is_mix]
    t0 = reg_d.intercept_ + reg_d.coef_[0] * Bm + reg_d.coef_[1] * Km
    X = np.column_stack([pm, pm * pm, pm * cm, pm * Km])
    reg_m, te, t_, p_ = fit_kind("mixed", X, ym - t0, t0, False)
    result["mixed"] = tuple(float(v) for v in reg_m.coef_)
    _regions(regions, "mixed", Bm[te], pm[te], t_, p_)

    fit_report = {"holdout": holdout, "samples": counts, "rejected": rejected,
                  "outlier_rule": f"|log residual - median| > {OUTLIER_ROBUST_SIGMAS} x 1.4826 MAD (training rows)",
                  "mape_regions": regions, "heldout_ratio_quantiles": quantiles, "max_mape": max_mape}
    model = LatencyModel(
        name=name, version=version,
        prefill_intercept_ms=result["prefill"][0], prefill_coef=result["prefill"][1],
        decode_intercept_ms=result["decode"][0], decode_coef=result["decode"][1],
        mixed_delta_coef=result["mixed"],
        kv_bytes_per_token=base.kv_bytes_per_token, links=dict(base.links), default_link=base.default_link,
        engine=base.engine,
        metadata={"provenance": "fit", "records": len(records), **(metadata or {}), "fit": fit_report},
        mape=mapes,
    )
    if max_mape is not None:
        bad = {k: round(v, 2) for k, v in mapes.items() if v is not None and v > max_mape}
        if bad:
            raise FitRefused(f"fit of {name}@{version} refused: held-out MAPE above {max_mape} % for {bad}", model)
    return model


def _regions(out: dict[str, dict[str, float]], kind: str, B: np.ndarray, p: np.ndarray, truth: np.ndarray,
             pred: np.ndarray) -> None:
    """Held-out MAPE per grid region of one kind into ``out[kind]`` (regions with ≥ 1 row)."""
    labels = [_region(kind, b, q) for b, q in zip(B, p)]
    per: dict[str, dict[str, float]] = {}
    for lab in sorted(set(labels)):
        m = np.array([x == lab for x in labels])
        per[lab] = {"mape": round(mape(truth[m], pred[m]), 3), "rows": int(m.sum())}
    out[kind] = per  # type: ignore[assignment]


def report_mape(model: LatencyModel, records: Sequence[StepRecord]) -> dict[str, float]:
    """MAPE (percent) of ``model`` on ``records``, per kind (``prefill``/``decode``/``mixed``).

    Kinds with no record are omitted.
    """
    out: dict[str, float] = {}
    groups: dict[str, tuple[list[float], list[float]]] = {"prefill": ([], []), "decode": ([], []), "mixed": ([], [])}
    for r in records:
        kind = "prefill" if r.batch_size == 0 else "decode" if r.prefill_tokens == 0 else "mixed"
        groups[kind][0].append(r.latency_ms)
        groups[kind][1].append(model.step_ms(r.batch_size, r.kv_tokens, r.prefill_tokens, r.prefill_cached))
    for k, (t, pr) in groups.items():
        if t:
            out[k] = mape(t, pr)
    return out
