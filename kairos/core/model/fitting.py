"""Fitting the step-latency model from recorded engine steps (paper §5.1–5.2).

Inputs: :class:`StepRecord` rows, one per engine step, from the profiler service
(``kairos.services.profiler``), ``kairos profile --testbed`` or a GPU bench (B, K, new prompt
tokens n or p, their cached prompt tokens c, and the measured step time in ms). Outputs: a
:class:`~kairos.core.model.latency.LatencyModel` whose coefficients are scikit-learn linear
regressions with non-negative coefficients on the features of :mod:`kairos.core.model.latency`,
with its held-out MAPE (percent) per component and per grid region and its fit report in
``metadata["fit"]`` (rejected rows, the outlier rule, held-out measured ÷ predicted quantiles, read
back by :func:`kairos.core.model.latency.tbt_safety_beta`); or :class:`FitRefused` when the MAPE is
above the caller's limit. :func:`report_mape` scores an existing model on new records.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kairos.core.model.latency import (DEFAULT_PROFILE, RATIO_QUANTILE_NAMES, RATIO_QUANTILES, LatencyModel,
                                       load_profile)


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

    def __init__(self, message: str, model: LatencyModel) -> None:
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
