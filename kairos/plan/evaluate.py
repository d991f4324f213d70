"""One simulated cluster per plan point, evaluated in parallel and cached by the hash of its inputs.

A :class:`Point` is one (policy, prefill nodes, decode nodes, request rate, seed); its
:class:`Outcome` is what ``kairos sim`` reports for it (:func:`kairos.sim.experiments.run_one`: SLO
attainment, P95 TTFT and TBT). The :class:`Evaluator` runs the points a search asks for on a process
pool (the simulations are independent) and keeps each outcome in a cache directory under a key that
hashes every input: the workload (and the bytes of its trace file), the latency profile's bytes, the
SLOs and policy parameters, the simulator settings and the source of the simulator and the policies.
Nothing here touches the network; the cache is the only I/O.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import msgspec

#: bumped when an outcome's meaning changes (older cache entries are then never read)
CACHE_SCHEMA = 2


@dataclass(frozen=True)
class PlanInputs:
    """What every point of one plan shares (all picklable: they travel to the worker processes).

    Attributes:
        workload: a ``--workload`` spec of ``kairos sim`` (``azure-code``, ``bursty``, ``trace:PATH``).
        duration_s: seconds of workload simulated per point.
        profile: bundled latency profile name or artifact path.
        link: KV link of the profile (None: its default).
        params: :class:`kairos.core.policy.PolicyParams` fields (α, β, τ = ``tbt_slo_ms``,
            ``ttft_slo_ms``), as a dict.
        heartbeat_ms: Δh of the simulated dispatcher, ms.
        noise: σ of the simulator's log-normal step noise (0: none).
        base_rps: the workload's own rate (requests/s); a point at a higher rate simulates
            proportionally fewer seconds (:func:`point_duration_s`), so every point costs about as
            many requests as the workload itself (None: every point runs ``duration_s``).
    """

    workload: str
    duration_s: float
    profile: str
    params: dict = field(default_factory=dict)
    link: str | None = None
    heartbeat_ms: float = 100.0
    noise: float = 0.0
    base_rps: float | None = None


#: ``Point.isolated``: seconds between two requests, more than any request takes alone
ISOLATION_GAP_S = 1e5


@dataclass(frozen=True, order=True)
class Point:
    """One simulated cluster: ``policy`` spec on ``prefill``P``decode``D at ``rps`` requests/s
    (None: the workload's own rate) with ``seed``. ``isolated``: the same requests, each alone on the
    idle cluster (arrivals :data:`ISOLATION_GAP_S` apart, the exact node state at each decision) —
    the attainment of the workload's *ceiling*: no queueing, so no cluster size does better."""

    policy: str
    prefill: int
    decode: int
    rps: float | None
    seed: int
    isolated: bool = False

    @property
    def nodes(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True)
class Outcome:
    """What one point scored: ``attainment`` (fraction of requests meeting both SLOs, 0–1, paper
    §6), ``ttft_p95_ms`` and ``tbt_p95_ms`` (None without data), ``requests`` simulated and
    ``deflections`` (prefills run on decode nodes)."""

    attainment: float
    ttft_p95_ms: float | None
    tbt_p95_ms: float | None
    requests: int
    deflections: int


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of the source of what computes an outcome (``kairos/core``, ``kairos/sim``): a changed
    policy, engine model or simulator never answers from an older cache entry."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for sub in ("core", "sim"):
        for f in sorted((root / sub).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def trace_file(workload: str) -> tuple[Path, str] | None:
    """The file of a ``trace:PATH`` workload spec and the suffix after it (``:busiest`` or ``""``,
    as :func:`kairos.core.workload.workloads.parse_workload` reads them); None for another workload."""
    if not workload.startswith("trace:"):
        return None
    path = workload[6:]
    suffix = path[-len(":busiest"):] if path.lower().endswith(":busiest") else ""
    return Path(path[: len(path) - len(suffix)]), suffix


def inputs_digest(inputs: PlanInputs) -> str:
    """sha256 of everything a point's outcome depends on besides the point itself: the inputs, the
    bytes of a ``trace:PATH`` workload and of the profile, and the code (:func:`code_digest`).
    Raises OSError if such a file cannot be read."""
    from kairos.core.model.latency import PROFILES_DIR

    files = {}
    trace = trace_file(inputs.workload)
    if trace is not None:
        files["workload"] = _file_digest(trace[0])
    prof = Path(inputs.profile)
    bundled = PROFILES_DIR / f"{inputs.profile}.json"
    files["profile"] = _file_digest(prof if prof.is_file() else bundled) if (prof.is_file() or bundled.is_file()) else None
    blob = json.dumps({"schema": CACHE_SCHEMA, "inputs": asdict(inputs), "files": files, "code": code_digest()},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@functools.lru_cache(maxsize=4)
def _model(profile: str, link: str | None):
    from kairos.core.model.latency import load_profile

    model = load_profile(profile)
    model.link(link)  # raises LatencyProfileError for an unknown link
    return model


@functools.lru_cache(maxsize=64)
def _workload(spec: str, rps: float | None, duration_s: float, seed: int, max_model_len: int):
    from kairos.core.workload.workloads import parse_workload

    return tuple(parse_workload(spec, rps, duration_s, seed, max_model_len=max_model_len))


#: the shortest workload (s) a point at a raised rate is simulated for
MIN_POINT_DURATION_S = 60.0


def point_duration_s(inputs: PlanInputs, rps: float | None) -> float:
    """Seconds of workload simulated at ``rps``: ``duration_s`` × ``base_rps`` / ``rps``, which keeps
    the workload's request count at every rate — longer for a lower rate, shorter for a higher one
    (never below :data:`MIN_POINT_DURATION_S`, or ``duration_s`` when that is shorter). The rate
    search probes from 1/256 to 256 × the workload's rate."""
    if rps is None or inputs.base_rps is None or rps == inputs.base_rps:
        return inputs.duration_s
    return max(min(MIN_POINT_DURATION_S, inputs.duration_s), inputs.duration_s * inputs.base_rps / rps)


def simulate(inputs: PlanInputs, point: Point) -> Outcome:
    """Run ``point`` in the simulator (as ``kairos sim`` would with the same options) and score it.

    Raises:
        kairos.core.workload.workloads.WorkloadError: the workload cannot be built at that rate.
        kairos.core.model.latency.LatencyProfileError: the profile or link is unknown.
        kairos.core.policy.PolicyError: an unknown policy spec or bad parameters.
    """
    from kairos.core.policy import PolicyParams, parse_policy
    from kairos.sim.experiments import run_one
    from kairos.sim.simulator import SimConfig

    from kairos.core.workload.workloads import WorkloadError

    model = _model(inputs.profile, inputs.link)
    policy = parse_policy(point.policy)
    duration_s = point_duration_s(inputs, point.rps)
    workload = _workload(inputs.workload, point.rps, duration_s, point.seed, model.engine.max_model_len)
    if not workload:
        raise WorkloadError(f"no request arrives in the {duration_s:g} s simulated at "
                            f"{'its own rate' if point.rps is None else f'{point.rps:g} req/s'}: a longer --duration")
    heartbeat_ms = inputs.heartbeat_ms
    if point.isolated:
        workload = tuple(msgspec.structs.replace(w, arrival_s=i * ISOLATION_GAP_S) for i, w in enumerate(workload))
        heartbeat_ms = 0.0  # the exact (idle) state, and no heartbeat events across the gaps
    cfg = SimConfig(n_prefill=point.prefill, n_decode=point.decode, heartbeat_ms=heartbeat_ms,
                    link=inputs.link, tbt_guard=policy.traits.node_guard, noise=inputs.noise, seed=point.seed)
    row = run_one(workload, policy, model, PolicyParams(**inputs.params), cfg, rps=point.rps)
    return Outcome(attainment=float(row["slo_attainment"]), ttft_p95_ms=row["ttft_ms"]["p95"],
                   tbt_p95_ms=row["tbt_ms"]["p95"], requests=int(row["requests"]),
                   deflections=int(row["deflections"]))


def _ignore_sigint() -> None:
    """A worker process leaves Ctrl-C to the plan's process, which stops the pool (Evaluator.abort),
    and dies of a SIGTERM (not the plan process's handler, inherited by the fork)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _simulate_star(args: tuple[PlanInputs, Point]) -> Outcome:
    return simulate(*args)


class PlanAborted(Exception):
    """The plan was stopped (Ctrl-C): every evaluation from now on raises this."""


def pin_trace(inputs: PlanInputs, directory: Path) -> PlanInputs:
    """``inputs`` with a ``trace:PATH`` workload replaced by a copy of the file's bytes as they are now,
    under ``directory/traces/<sha256>.<suffix>``: the hash the cache keys on is the hash of what every
    point simulates, whatever happens to PATH during the plan. Other workloads are returned as they
    are. Raises OSError (unreadable trace, unwritable directory)."""
    trace = trace_file(inputs.workload)
    if trace is None:
        return inputs
    src, suffix = trace
    data = src.read_bytes()
    copy = directory / "traces" / f"{hashlib.sha256(data).hexdigest()}{''.join(src.suffixes[-2:])}"
    if not copy.is_file():
        _write_atomic(copy, data)
    return replace(inputs, workload=f"trace:{copy}{suffix}")


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` through a temporary file renamed over it: a concurrent reader (another plan on
    the same cache) sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


class Evaluator:
    """Evaluates batches of points: from the cache when it holds them, else on ``jobs`` worker
    processes (1: in this process), then stores them.

    Attributes:
        simulated: points simulated so far; ``cached``: points answered from the cache.
    """

    def __init__(self, inputs: PlanInputs, cache_dir: Path | None, jobs: int = 1,
                 progress: Callable[[int, int], None] | None = None,
                 run: Callable[[PlanInputs, Point], Outcome] = simulate) -> None:
        self.inputs, self.jobs, self.progress, self._run = inputs, max(1, jobs), progress, run
        self.cache_dir = cache_dir / inputs_digest(inputs) if cache_dir is not None else None
        self.simulated = self.cached = 0
        self._memo: dict[Point, Outcome] = {}
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.aborted = False

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker processes (if any were started)."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def abort(self) -> None:
        """Stop the plan: every evaluation from now on raises :class:`PlanAborted`, queued simulations
        are cancelled, the workers stop."""
        self.aborted = True
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _path(self, p: Point) -> Path | None:
        if self.cache_dir is None:
            return None
        name = hashlib.sha256(json.dumps(asdict(p), sort_keys=True).encode()).hexdigest()[:32]
        return self.cache_dir / f"{name}.json"

    def _load(self, p: Point) -> Outcome | None:
        path = self._path(p)
        if path is None or not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            o = msgspec.convert(data["outcome"], Outcome) if data.get("point") == asdict(p) else None
        except (OSError, ValueError, TypeError, KeyError, AttributeError, msgspec.ValidationError):
            return None  # a torn or foreign file, a field of the wrong type: simulated again and rewritten
        if o is None or not 0 <= o.attainment <= 1:  # a float by the typed conversion; NaN fails too
            return None
        return o

    def _store(self, p: Point, o: Outcome) -> None:
        path = self._path(p)
        if path is None:
            return
        try:
            _write_atomic(path, json.dumps({"point": asdict(p), "outcome": asdict(o)}).encode())
        except OSError:  # the cache is an aid: an entry that cannot be written (a directory in its place) is skipped
            with contextlib.suppress(OSError):
                path.with_name(f"{path.name}.{os.getpid()}.tmp").unlink(missing_ok=True)

    def evaluate(self, points: Sequence[Point]) -> list[Outcome]:
        """The outcomes of ``points``, in their order (duplicates simulated once). Thread-safe: the
        planner searches its policies side by side, each thread handing its batches here.
        Raises PlanAborted after :meth:`abort`."""
        if self.aborted:
            raise PlanAborted("the plan was stopped")
        with self._lock:
            todo = []
            for p in dict.fromkeys(points):
                if p in self._memo:
                    continue
                hit = self._load(p)
                if hit is not None:
                    self._memo[p] = hit
                    self.cached += 1
                else:
                    todo.append(p)
            if todo and self._pool is None and self.jobs > 1 and self._run is simulate:
                self._pool = ProcessPoolExecutor(max_workers=self.jobs, initializer=_ignore_sigint)
            pool = self._pool
        if todo:
            try:
                if pool is None:  # one point too goes to the pool: the other policy's search may hold this process
                    results = []
                    for p in todo:
                        if self.aborted:
                            raise PlanAborted("the plan was stopped")
                        results.append(self._run(self.inputs, p))
                else:
                    results = list(pool.map(_simulate_star, [(self.inputs, p) for p in todo]))
            except Exception:
                if self.aborted:  # a cancelled future, a pool shut down under it
                    raise PlanAborted("the plan was stopped") from None
                raise
            if self.aborted:
                raise PlanAborted("the plan was stopped")
            with self._lock:
                for p, o in zip(todo, results):
                    self._memo[p] = o
                    self._store(p, o)
                self.simulated += len(todo)
        if self.progress:
            self.progress(self.simulated, self.cached)
        return [self._memo[p] for p in points]


def workload_rate(spec: str, seed: int, max_model_len: int) -> float:
    """The mean rate (requests/s) a ``--rps`` of the workload means: the paper's Table 1 rate of a
    generated workload, the whole trace's (n − 1) / (last − first arrival) of a trace (what
    :func:`kairos.core.workload.workloads.rescale_to_rps` sets). Raises WorkloadError."""
    from kairos.core.workload.workloads import TABLE1_RPS, WorkloadError, parse_workload

    key = spec.strip().lower().removesuffix(":busiest")
    if key in TABLE1_RPS:
        return float(TABLE1_RPS[key])
    reqs = parse_workload(spec.strip()[: len(key)], None, None, seed, max_model_len=max_model_len)
    times = [r.arrival_s for r in reqs]
    if len(times) < 2 or max(times) <= min(times):
        raise WorkloadError(f"{spec}: fewer than two distinct arrival times, no rate to plan from")
    return (len(times) - 1) / (max(times) - min(times))
