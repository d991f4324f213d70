"""Workloads: requests with arrival times and token lengths (paper §3, Table 1; docs/calibration.md).

A workload is a ``list[WorkloadRequest]`` sorted by ``arrival_s`` (seconds from the workload
start). Where it comes from: :func:`generate` (the paper's five synthetic workloads), the loaders
(bundled public traces in ``kairos/core/data/traces/``, see its ``LICENSES.md``, or a user's file), all behind
:func:`parse_workload` for the CLI. Where it goes: the simulator and the live ``kairos bench``
client. No network or ``/work/shared`` access: the bundled traces ship as package data.

Generated lengths. The paper's workloads come from a private production trace; we only have its
percentiles (§3): prompt P25/P50/P90 = 2,071 / 3,569 / 10,336, completion 21 / 50 / 163. We draw
prompt and completion independently from log-normals fitted to them (prompt median 3,569,
σ = 0.83, which reproduces P25 ≈ 2,040 and P90 ≈ 10,340; completion median 50, σ = 0.9, which
gives P25 ≈ 27 and P90 ≈ 158). We do not resample the public traces: their shapes differ (Azure
code: median prompt 1,469, median output 13). Strata (§3): LP = prompt < P25, HP = prompt > P90,
LD = completion < P25, HD = completion > P90, drawn by rejection from the same log-normals, so
they are the paper's strata of a log-normal, not of the real trace. Measured medians
(``generate(kind, rps=100, duration_s=200, seed=0)``, ~20,200 requests each; prompt / completion)
against Table 1:

    workload   ours             Table 1
    LPLD       1,385 / 14       842 / 15
    LPHD       1,396 / 226      998 / 191
    HPLD       14,025 / 14      14,013 / 9
    HPHD       13,948 / 226     13,968 / 198
    Bursty     3,564 / 50       3,569 / 50

LP prompt medians are ~40-65 % above Table 1 (the real trace has more very short prompts than a
log-normal) and HD completions ~15 % above; LD completions land between the LPLD and HPLD values;
HP and Bursty are close. Prompts are capped so that prompt + completion ≤ ``max_model_len``
(default 32,768, the context window of §3); the completion is kept.

Generated arrivals: Poisson (exponential inter-arrivals, mean 1/rps) for the four strata; Gamma
inter-arrivals with mean 1/rps and shape k (CV = 1/√k) for Bursty. Default k = 0.25 (CV 2): the
paper gives no shape, and the public Azure code trace, the burstiest we have, fits k ≈ 0.23
(Gamma MLE on its inter-arrivals, CV 13), so 0.25 is a realistic, clearly bursty default.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Annotated, Literal, get_args

import msgspec
import numpy as np

TRACES_DIR = Path(__file__).resolve().parents[1] / "data" / "traces"
#: bundled trace name (workload spec) → file in :data:`TRACES_DIR`
BUNDLED_TRACES: dict[str, str] = {
    "azure-code": "AzureLLMInferenceTrace_code_2023.csv",
    "azure-conv": "AzureLLMInferenceTrace_conv_2023.csv",
    "mooncake": "mooncake_conversation_trace.jsonl",
}
DEFAULT_MAX_MODEL_LEN = 32768  #: context window in tokens (§3: DeepSeek-V2-Lite, 32K)
MOONCAKE_BUCKET_MS = 3000.0  #: the Mooncake trace's timestamps are rounded to ~3 s buckets
MOONCAKE_BLOCK_TOKENS = 512  #: tokens per ``hash_ids`` block of the Mooncake trace (its README)

# Paper §3 overall percentiles (tokens) and the log-normal σ fitted to them (docs/calibration.md).
PROMPT_P25, PROMPT_P50, PROMPT_P90 = 2071, 3569, 10336
OUTPUT_P25, OUTPUT_P50, OUTPUT_P90 = 21, 50, 163
PROMPT_SIGMA = 0.83
OUTPUT_SIGMA = 0.9
DEFAULT_GAMMA_SHAPE = 0.25  #: Bursty inter-arrival Gamma shape k; CV = 1/sqrt(k) = 2

Kind = Literal["lpld", "lphd", "hpld", "hphd", "bursty"]
KINDS: tuple[str, ...] = get_args(Kind)
#: Table 1 request rates (requests/s), used by :func:`parse_workload` when no rate is given.
TABLE1_RPS: dict[str, float] = {"lpld": 22.0, "lphd": 20.0, "hpld": 1.0, "hphd": 1.0, "bursty": 4.0}

_NO_MAX = 2**62
_LOW_P, _HIGH_P, _ANY_P = (1, PROMPT_P25 - 1), (PROMPT_P90 + 1, _NO_MAX), (1, _NO_MAX)
_LOW_D, _HIGH_D, _ANY_D = (1, OUTPUT_P25 - 1), (OUTPUT_P90 + 1, _NO_MAX), (1, _NO_MAX)
#: kind → (inclusive prompt bounds, inclusive completion bounds); §3 "high > P90, low < P25"
_STRATA: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "lpld": (_LOW_P, _LOW_D), "lphd": (_LOW_P, _HIGH_D),
    "hpld": (_HIGH_P, _LOW_D), "hphd": (_HIGH_P, _HIGH_D), "bursty": (_ANY_P, _ANY_D),
}
_VALID_SPECS = "bursty, lpld, lphd, hpld, hphd, azure-code, azure-conv, mooncake, trace:PATH"


class WorkloadError(ValueError):
    """A workload spec, parameter or trace file is invalid; the message names the file and
    line or field, or lists the valid choices."""


#: Longest workload `kairos sim` / `kairos bench` generate, seconds (a week), and the highest rate:
#: beyond them the request list alone would not fit in memory.
MAX_WORKLOAD_S = 7 * 24 * 3600.0
MAX_RPS = 100_000.0
#: Most requests a workload asked for by count may hold (``kairos bench --num-prompts``): ~10 million
#: request objects and their bench records already take GBs; the count's span (count ÷ rate) is
#: further held to :data:`MAX_WORKLOAD_S` where the rate is known (:mod:`kairos.core.workload.counted`).
MAX_REQUESTS = 10_000_000


class WorkloadSizeError(WorkloadError):
    """A workload length, rate or count out of bounds; ``param`` names it (``duration``, ``rps`` or
    ``num_requests``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_workload_size(duration_s: float | None, rates: Sequence[float | None],
                        num_requests: int | None = None) -> None:
    """The workload length ``duration_s`` (s) and every rate in ``rates`` (requests/s) must be
    finite, > 0 and within :data:`MAX_WORKLOAD_S` / :data:`MAX_RPS`, a request count
    ``num_requests`` in [1, :data:`MAX_REQUESTS`] (None: not given, the default).

    Raises:
        WorkloadSizeError: naming the parameter (``duration``, ``rps`` or ``num_requests``) and the bound.
    """
    if duration_s is not None and not (math.isfinite(duration_s) and 0 < duration_s <= MAX_WORKLOAD_S):
        raise WorkloadSizeError("duration", f"must be > 0 and <= {MAX_WORKLOAD_S:g} s, got {duration_s:g}")
    for r in rates:
        if r is not None and not (math.isfinite(r) and 0 < r <= MAX_RPS):
            raise WorkloadSizeError("rps", f"must be > 0 and <= {MAX_RPS:g} requests/s, got {r:g}")
    if num_requests is not None and not 1 <= num_requests <= MAX_REQUESTS:
        raise WorkloadSizeError("num_requests", f"must be >= 1 and <= {MAX_REQUESTS} requests, got {num_requests}")


class WorkloadRequest(msgspec.Struct, frozen=True):
    """One request of a workload (immutable)."""

    id: str  #: deterministic id: ``"<kind or trace>-<index:06d>"``, index = generation/file row order
    arrival_s: float  #: arrival time in seconds since the workload start, >= 0
    prompt_tokens: int  #: prompt length in tokens, >= 1
    output_tokens: int  #: completion length in tokens (the replay's max_tokens), >= 1
    #: prefix-cache hashes of the prompt's blocks (block i's hash stands for tokens
    #: [0, (i+1)·bt)): the Mooncake trace's ``hash_ids`` (bt = :data:`MOONCAKE_BLOCK_TOKENS`); empty
    #: for traces and generators without content (no prefix reuse is invented)
    block_hashes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise WorkloadError(f"request {self.id}: arrival_s must be finite and >= 0, got {self.arrival_s}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise WorkloadError(f"request {self.id}: token counts must be >= 1, got "
                                f"prompt_tokens={self.prompt_tokens}, output_tokens={self.output_tokens}")


# --- Trace loaders ----------------------------------------------------------------------------------

def _fit(prompt: int, output: int, max_model_len: int) -> tuple[int, int]:
    """Clamp a trace pair: output ≥ 1 (0 → 1), prompt capped so prompt + output ≤ max_model_len."""
    output = min(max(output, 1), max_model_len - 1)
    return min(prompt, max_model_len - output), output


def _build(path: Path, prefix: str | None, rows: Sequence[tuple[float, int, int]],
           max_model_len: int, hashes: Sequence[tuple[int, ...]] | None = None) -> list[WorkloadRequest]:
    """Requests from (arrival_s, prompt, output) rows (and per-row block hashes): ids by file row,
    sorted by arrival (stable, so file order breaks ties)."""
    if not rows:
        raise WorkloadError(f"{path}: no requests")
    if max_model_len < 2:
        raise WorkloadError(f"max_model_len must be >= 2, got {max_model_len}")
    reqs = [WorkloadRequest(f"{prefix or path.stem}-{i:06d}", float(t), *_fit(p, o, max_model_len),
                            block_hashes=hashes[i] if hashes else ())
            for i, (t, p, o) in enumerate(rows)]
    return sorted(reqs, key=lambda r: r.arrival_s)


@contextmanager
def _open(path: Path) -> Iterator[IO[str]]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            yield f
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _int_field(value: str, name: str, where: str, minimum: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise WorkloadError(f"{where}: field {name}: not an integer: {value!r}") from None
    if n < minimum:
        raise WorkloadError(f"{where}: field {name}: must be >= {minimum}, got {n}")
    return n


def _csv_rows(path: Path, columns: Sequence[str]) -> Iterator[tuple[str, dict[str, str]]]:
    """Yield ``("path:line", {column: value})`` for each non-blank data row; check the header."""
    with _open(path) as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in columns if c not in header]
        if missing:
            raise WorkloadError(f"{path}:1: header {header} lacks column(s) {missing}")
        index = {c: header.index(c) for c in columns}
        for row in reader:
            if not any(cell.strip() for cell in row):
                continue
            where = f"{path}:{reader.line_num}"
            if len(row) != len(header):
                raise WorkloadError(f"{where}: expected {len(header)} fields, got {len(row)}")
            yield where, {c: row[i].strip() for c, i in index.items()}


def load_azure_csv(path: str | Path, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                   id_prefix: str | None = None) -> list[WorkloadRequest]:
    """Load an Azure LLM inference trace (columns ``TIMESTAMP,ContextTokens,GeneratedTokens``).

    ``TIMESTAMP`` is a wall-clock ISO time such as ``"2023-11-16 18:15:46.6805900"`` (100 ns
    digits are read to µs precision; a time zone suffix is honoured, none means UTC). Arrivals are
    seconds since the earliest row (the first row in the sorted public traces). Zero
    ``GeneratedTokens`` are clamped to 1; prompts are capped so that prompt + output ≤
    ``max_model_len`` (output kept). Ids are ``f"{id_prefix or path.stem}-{row:06d}"``.

    Raises:
        WorkloadError: unreadable file, missing column, or a bad field (message names file:line
            and the field), or a file without data rows.
    """
    path = Path(path)
    rows: list[tuple[datetime, int, int]] = []
    for where, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        try:
            ts = datetime.fromisoformat(row["TIMESTAMP"])
        except ValueError:
            raise WorkloadError(f"{where}: field TIMESTAMP: not a timestamp: {row['TIMESTAMP']!r}") from None
        rows.append((ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc),
                     _int_field(row["ContextTokens"], "ContextTokens", where, 1),
                     _int_field(row["GeneratedTokens"], "GeneratedTokens", where, 0)))
    t0 = min((r[0] for r in rows), default=None)
    return _build(path, id_prefix, [((t - t0).total_seconds(), p, o) for t, p, o in rows], max_model_len)


class _MooncakeRow(msgspec.Struct):
    timestamp: Annotated[float, msgspec.Meta(ge=0)]  # ms, rounded to ~3 s buckets
    input_length: Annotated[int, msgspec.Meta(ge=1)]  # prompt tokens
    output_length: Annotated[int, msgspec.Meta(ge=0)]  # completion tokens (0 is clamped to 1)
    hash_ids: list[int] = []  # one id per 512-token block of the prompt, shared prefixes share ids


def load_mooncake_jsonl(path: str | Path, seed: int = 0, *, bucket_ms: float = MOONCAKE_BUCKET_MS,
                        max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                        id_prefix: str | None = None) -> list[WorkloadRequest]:
    """Load a Mooncake JSON-lines trace (fields ``timestamp`` in ms, ``input_length``,
    ``output_length``, optional ``hash_ids``).

    ``hash_ids`` (one per :data:`MOONCAKE_BLOCK_TOKENS`-token block; requests sharing a prefix
    share its ids — the Mooncake paper's salted block hashes, each standing for the whole prefix
    up to its block) become ``block_hashes``, so the engines' prefix caches see the trace's reuse.

    The public timestamps are rounded to ~3 s buckets, which would replay as bursts of simultaneous
    arrivals. Each distinct timestamp ``t`` is a bucket ``[t, t + w)`` with ``w = min(bucket_ms,
    next distinct timestamp - t)``; its arrivals are drawn uniformly inside it with
    ``numpy.random.default_rng(seed)``, so buckets never overlap and the result is reproducible.
    Arrivals are seconds since the earliest timestamp. Zero outputs are clamped to 1; prompts are
    capped so that prompt + output ≤ ``max_model_len`` (output kept; 828 of the bundled 12,031
    prompts exceed 32K). Ids are ``f"{id_prefix or path.stem}-{row:06d}"`` (0-based data row).

    Raises:
        WorkloadError: unreadable file, bad JSON or field (message names file:line and the
            field path, e.g. ``$.input_length``), or a file without data rows.
    """
    path = Path(path)
    decoder = msgspec.json.Decoder(_MooncakeRow)
    stamps: list[float] = []
    lengths: list[tuple[int, int]] = []
    hashes: list[tuple[int, ...]] = []
    with _open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = decoder.decode(line)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise WorkloadError(f"{path}:{lineno}: {exc}") from None
            stamps.append(row.timestamp)
            lengths.append((row.input_length, row.output_length))
            hashes.append(tuple(row.hash_ids))
    if not stamps:
        raise WorkloadError(f"{path}: no requests")
    ts = np.asarray(stamps)
    starts, bucket = np.unique(ts, return_inverse=True)
    width = np.minimum(bucket_ms, np.diff(starts, append=starts[-1] + bucket_ms))
    offsets = np.random.default_rng(seed).uniform(0.0, 1.0, ts.size) * width[bucket]
    arrivals_s = (ts - starts[0] + offsets) / 1000.0
    return _build(path, id_prefix, [(t, p, o) for t, (p, o) in zip(arrivals_s.tolist(), lengths)],
                  max_model_len, hashes)


def load_plain_csv(path: str | Path, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                   id_prefix: str | None = None) -> list[WorkloadRequest]:
    """Load a plain CSV workload with header ``arrival_s,prompt_tokens,output_tokens`` (extra
    columns ignored). Arrivals are seconds, kept as given (not re-based). Zero outputs are clamped
    to 1, prompts capped so that prompt + output ≤ ``max_model_len``.

    Raises:
        WorkloadError: unreadable file, missing column, bad field (names file:line and field),
            or a file without data rows.
    """
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    for where, row in _csv_rows(path, ("arrival_s", "prompt_tokens", "output_tokens")):
        try:
            t = float(row["arrival_s"])
        except ValueError:
            raise WorkloadError(f"{where}: field arrival_s: not a number: {row['arrival_s']!r}") from None
        if not (math.isfinite(t) and t >= 0):
            raise WorkloadError(f"{where}: field arrival_s: must be finite and >= 0, got {t}")
        rows.append((t, _int_field(row["prompt_tokens"], "prompt_tokens", where, 1),
                     _int_field(row["output_tokens"], "output_tokens", where, 0)))
    return _build(path, id_prefix, rows, max_model_len)


def load_trace(path: str | Path, *, seed: int = 0, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
               id_prefix: str | None = None) -> list[WorkloadRequest]:
    """Load a trace, choosing the format: ``.jsonl`` → Mooncake; ``.csv`` with a ``TIMESTAMP``
    column → Azure; ``.csv`` with ``arrival_s`` → plain. ``seed`` only matters for Mooncake.

    Raises:
        WorkloadError: unknown format or any loader error.
    """
    path = Path(path)
    if path.suffix == ".jsonl":
        return load_mooncake_jsonl(path, seed, max_model_len=max_model_len, id_prefix=id_prefix)
    if path.suffix == ".csv":
        with _open(path) as f:
            header = {h.strip() for h in next(csv.reader(f), [])}
        if "TIMESTAMP" in header:
            return load_azure_csv(path, max_model_len=max_model_len, id_prefix=id_prefix)
        if "arrival_s" in header:
            return load_plain_csv(path, max_model_len=max_model_len, id_prefix=id_prefix)
    raise WorkloadError(f"{path}: unknown trace format (expected .jsonl Mooncake, or .csv with a "
                        f"TIMESTAMP or arrival_s column)")


# --- Time manipulation ------------------------------------------------------------------------------

def window(requests: Sequence[WorkloadRequest], start_s: float, duration_s: float) -> list[WorkloadRequest]:
    """Requests arriving in ``[start_s, start_s + duration_s)`` (seconds), re-based so that
    ``start_s`` becomes 0. Order and ids are kept."""
    end = start_s + duration_s
    return [msgspec.structs.replace(r, arrival_s=r.arrival_s - start_s)
            for r in requests if start_s <= r.arrival_s < end]


def busiest_window(requests: Sequence[WorkloadRequest], duration_s: float) -> tuple[float, list[WorkloadRequest]]:
    """The ``duration_s``-second window holding the most arrivals (earliest one on ties).

    Returns ``(start_s, window(requests, start_s, duration_s))``; the window starts at an arrival,
    so its first request is at 0. Empty input → ``(0.0, [])``. E.g. ``busiest_window(
    load_azure_csv(TRACES_DIR / BUNDLED_TRACES["azure-code"]), 60.0)`` for a busy minute.
    """
    if not requests:
        return 0.0, []
    t = np.sort(np.fromiter((r.arrival_s for r in requests), float, len(requests)))
    counts = np.searchsorted(t, t + duration_s, side="left") - np.arange(t.size)
    start = float(t[int(np.argmax(counts))])
    return start, window(requests, start, duration_s)


def rescale_to_rps(requests: Sequence[WorkloadRequest], rps: float) -> list[WorkloadRequest]:
    """Scale arrival times so that the mean rate, (n − 1) / (last − first arrival), equals ``rps``
    (requests/s); the shape of the arrival process (bursts, idle gaps) is kept.

    Raises:
        WorkloadError: ``rps`` not finite and > 0, fewer than two requests, or all arrivals simultaneous.
    """
    if not (math.isfinite(rps) and rps > 0):
        raise WorkloadError(f"rps must be finite and > 0, got {rps}")
    times = [r.arrival_s for r in requests]
    span = max(times, default=0.0) - min(times, default=0.0)
    if len(times) < 2 or span <= 0:
        raise WorkloadError("cannot rescale a workload with fewer than two distinct arrival times")
    factor = span / (len(times) - 1) * rps  # old mean gap / new mean gap (1/rps)
    return [msgspec.structs.replace(r, arrival_s=r.arrival_s / factor) for r in requests]


# --- Generators (§3 workloads) ----------------------------------------------------------------------

def _lognormal_ints(rng: np.random.Generator, n: int, median: float, sigma: float,
                    bounds: tuple[int, int]) -> np.ndarray:
    """``n`` rounded log-normal draws restricted to the inclusive ``bounds`` (rejection)."""
    lo, hi = bounds
    z = [(math.log(b) - math.log(median)) / sigma for b in (lo - 0.5, min(hi, 1e12) + 0.5)]
    accept = 0.5 * (math.erf(z[1] / math.sqrt(2)) - math.erf(z[0] / math.sqrt(2)))
    parts, have = [], 0
    while have < n:
        batch = int((n - have) / accept * 1.1) + 64
        x = np.rint(rng.lognormal(math.log(median), sigma, batch)).astype(np.int64)
        x = x[(x >= lo) & (x <= hi)]
        parts.append(x)
        have += x.size
    return np.concatenate(parts)[:n] if parts else np.empty(0, np.int64)


def _arrivals(rng: np.random.Generator, rps: float, duration_s: float, gamma_shape: float | None) -> np.ndarray:
    """Arrival times in [0, duration_s): exponential gaps (Poisson) or Gamma(k, 1/(k·rps)) gaps."""
    chunk = int(rps * duration_s * 1.1) + 64
    parts, t = [], 0.0
    while t < duration_s:
        gaps = (rng.exponential(1.0 / rps, chunk) if gamma_shape is None
                else rng.gamma(gamma_shape, 1.0 / (gamma_shape * rps), chunk))
        times = t + np.cumsum(gaps)
        parts.append(times)
        t = float(times[-1])
    times = np.concatenate(parts)
    return times[times < duration_s]


def generate(kind: Kind | str, rps: float, duration_s: float, seed: int, *,
             max_model_len: int = DEFAULT_MAX_MODEL_LEN,
             gamma_shape: float = DEFAULT_GAMMA_SHAPE) -> list[WorkloadRequest]:
    """Generate one of the paper's workloads (§3, Table 1): ``lpld``, ``lphd``, ``hpld``,
    ``hphd`` (Poisson arrivals) or ``bursty`` (Gamma inter-arrivals, shape ``gamma_shape``).

    ``rps`` is the mean arrival rate (requests/s), ``duration_s`` the span in seconds (arrivals in
    ``[0, duration_s)``). Lengths are drawn from the log-normals and strata of the module
    docstring, then prompts are capped so that prompt + completion ≤ ``max_model_len``. Arrivals
    and lengths use independent streams spawned from ``seed``. Ids are ``f"{kind}-{i:06d}"``.

    Raises:
        WorkloadError: unknown kind, rps/duration/gamma_shape ≤ 0, or a ``max_model_len`` too
            small for the stratum (HP needs ≥ 10,338 tokens; HPHD ≥ 10,501).
    """
    kind = str(kind).lower()
    if kind not in _STRATA:
        raise WorkloadError(f"unknown workload kind {kind!r}; valid: {', '.join(KINDS)}")
    for name, value in (("rps", rps), ("duration_s", duration_s), ("gamma_shape", gamma_shape)):
        if not (math.isfinite(value) and value > 0):
            raise WorkloadError(f"{name} must be finite and > 0, got {value}")
    (p_lo, p_hi), (o_lo, o_hi) = _STRATA[kind]
    if max_model_len < p_lo + o_lo:
        raise WorkloadError(f"max_model_len={max_model_len} cannot hold a {kind} request "
                            f"(needs >= {p_lo + o_lo} tokens)")
    arrival_seq, length_seq = np.random.SeedSequence(seed).spawn(2)
    times = _arrivals(np.random.default_rng(arrival_seq), rps, duration_s,
                      gamma_shape if kind == "bursty" else None)
    rng = np.random.default_rng(length_seq)
    outputs = np.minimum(_lognormal_ints(rng, times.size, OUTPUT_P50, OUTPUT_SIGMA, (o_lo, o_hi)),
                         max_model_len - p_lo)
    prompts = np.minimum(_lognormal_ints(rng, times.size, PROMPT_P50, PROMPT_SIGMA, (p_lo, p_hi)),
                         max_model_len - outputs)
    return [WorkloadRequest(f"{kind}-{i:06d}", float(t), int(p), int(o))
            for i, (t, p, o) in enumerate(zip(times, prompts, outputs))]


def parse_workload(spec: str, rps: float | None, duration_s: float | None, seed: int,
                   max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> list[WorkloadRequest]:
    """Build the workload named by a CLI spec.

    * ``lpld|lphd|hpld|hphd|bursty``: :func:`generate`; ``rps`` None → the Table 1 rate
      (:data:`TABLE1_RPS`); ``duration_s`` is required.
    * ``azure-code|azure-conv|mooncake`` (bundled traces) or ``trace:PATH`` (see
      :func:`load_trace`): if ``rps`` is given, arrival times are scaled so the whole trace's mean
      rate is ``rps`` (:func:`rescale_to_rps`; bursts keep their shape, so a short window's own
      rate can differ); otherwise the trace's own timing is kept. Then, if ``duration_s`` is
      given, only ``[0, duration_s)`` is kept. A ``:busiest`` suffix (``azure-code:busiest``) keeps
      instead the ``duration_s`` window with the most arrivals (:func:`busiest_window`), re-based
      to 0. ``seed`` only affects Mooncake's within-bucket spreading.

    Raises:
        WorkloadError: unknown spec (the message lists the valid ones) or any generator/loader error.
    """
    key = spec.strip().lower()
    busiest = key.endswith(":busiest")
    if busiest:
        spec, key = spec.strip()[: -len(":busiest")], key[: -len(":busiest")]
        if key in _STRATA or duration_s is None:
            raise WorkloadError(f"':busiest' applies to traces with a duration, not to {spec!r}")
    if key in _STRATA:
        if duration_s is None:
            raise WorkloadError(f"workload {key!r} needs a duration_s")
        return generate(key, TABLE1_RPS[key] if rps is None else rps, duration_s, seed,
                        max_model_len=max_model_len)
    if key in BUNDLED_TRACES:
        path, prefix = TRACES_DIR / BUNDLED_TRACES[key], key
    elif key.startswith("trace:") and spec.strip()[6:]:
        path, prefix = Path(spec.strip()[6:]), "trace"
    else:
        raise WorkloadError(f"unknown workload {spec!r}; valid: {_VALID_SPECS}")
    requests = load_trace(path, seed=seed, max_model_len=max_model_len, id_prefix=prefix)
    if rps is not None:
        requests = rescale_to_rps(requests, rps)
    if duration_s is not None:
        requests = busiest_window(requests, duration_s)[1] if busiest else window(requests, 0.0, duration_s)
    return requests
