"""What one simulated run records: per-request timings in virtual time, and the run's result.

Inputs: the simulator's event handlers fill one :class:`SimRequest` per arrival (times in ms of
virtual time) and one :class:`DeflectedStep` per executed step of a deflected prefill. Outputs:
:func:`request_record` turns a finished (or unfinished) :class:`SimRequest` into the
:class:`~kairos.core.workload.serving_metrics.RequestRecord` that the live bench also produces,
and :class:`SimResult` carries those records plus the step latencies to
:mod:`kairos.sim.experiments` and ``kairos.core.workload.serving_metrics.summarize``.

TTFT components (ms): prefill queue = first prefill chunk start − arrival; prefill exec = prefill
end − first chunk start; KV transfer = KV arrived − prefill end; decode queue = first token − KV
arrived. A deflected request (or, under TaiChi, one that decodes on its prefill node) has the last
two at 0. The four sum to the TTFT exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kairos.core.workload.serving_metrics import RequestRecord
from kairos.core.workload.workloads import WorkloadRequest


@dataclass(eq=False)
class SimRequest:
    """One request in the simulator (compared by identity): where it was routed and when each of
    its phases happened (ms of virtual time)."""

    w: WorkloadRequest
    deflected: bool = False
    prefill_node: int = -1
    decode_node: int = -1
    prefill_start_ms: float | None = None
    prefill_end_ms: float | None = None
    kv_arrived_ms: float | None = None
    first_token_ms: float | None = None
    token_times_ms: list[float] = field(default_factory=list)
    # deflection bookkeeping: decodes running at decision and predicted step ms (violation attribution)
    decided_decodes: frozenset[str] = frozenset()
    predicted_steps: list[float] = field(default_factory=list)
    # TaiChi flowing decode: decoding on its prefill node; migration in progress; tokens at its start
    local: bool = False
    migrating: bool = False
    migrate_from: int = 0
    done: bool = False
    transfer_tokens: int = 0  #: keep path: prompt tokens the decode node lacked (KV transferred)
    cached_tokens: int = 0  #: prompt tokens the prefilling node served from its prefix cache


@dataclass
class DeflectedStep:
    """One executed step of a deflected prefill (for TBT-violation attribution)."""

    request_id: str
    step_index: int
    predicted_ms: float | None  #: the dispatcher's prediction for this step (None past the plan)
    actual_ms: float
    batch_at_decision: int
    batch_at_step: int
    decode_joined: bool  #: a decode that was not running at the decision is in this step's batch


@dataclass
class SimResult:
    """Raw output of one run."""

    records: list[RequestRecord]
    #: latency of every step with ≥ 1 decode in it (decode nodes; prefill nodes only under TaiChi)
    decode_step_ms: list[float]
    deflected_steps: list[DeflectedStep]
    deflections: int
    sim_seconds: float
    #: (end time ms, node) of each entry of ``decode_step_ms``: decode node index i, or −1−i for
    #: prefill node i (drift analysis)
    decode_step_at: list[tuple[float, int]] = field(default_factory=list)


def request_record(r: SimRequest) -> RequestRecord:
    """The serving record of ``r``: TTFT, token times (s) and the four TTFT components (ms); a
    request without a first token is recorded with ``error="not finished"``."""
    a = r.w.arrival_s * 1000.0
    if r.first_token_ms is None:
        return RequestRecord(id=r.w.id, arrival_s=r.w.arrival_s, prompt_tokens=r.w.prompt_tokens,
                             output_tokens=0, deflected=r.deflected, error="not finished")
    pq = r.prefill_start_ms - a
    if r.deflected or r.local:
        pe, kv, dq = r.first_token_ms - r.prefill_start_ms, 0.0, 0.0
    else:
        pe = r.prefill_end_ms - r.prefill_start_ms
        kv = r.kv_arrived_ms - r.prefill_end_ms
        dq = r.first_token_ms - r.kv_arrived_ms
    return RequestRecord(
        id=r.w.id, arrival_s=r.w.arrival_s, prompt_tokens=r.w.prompt_tokens,
        output_tokens=len(r.token_times_ms), ttft_ms=r.first_token_ms - a,
        token_times_s=[t / 1000.0 for t in r.token_times_ms], deflected=r.deflected,
        prefill_queue_ms=pq, prefill_exec_ms=pe, kv_transfer_ms=kv, decode_queue_ms=dq,
        cached_tokens=r.cached_tokens)
