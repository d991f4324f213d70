"""Pieces every policy shares: choosing the prefill node and the KV receiver of the keep path."""

from __future__ import annotations

import zlib
from operator import attrgetter
from typing import Callable, Sequence, TypeVar

from kairos.core.model.latency import LatencyModel
from kairos.core.policy.base import PolicyParams
from kairos.core.policy.estimates import prefill_exec_ms, prefill_queue_wait_ms
from kairos.core.cluster.snapshot import ClusterSnapshot


def request_hit(node, prompt_tokens: int) -> int:
    """Cached prefix tokens of the routed request on ``node`` (a snapshot node view), capped so
    that at least one prompt token is computed (as the engines do)."""
    c = node.cached_prefix_tokens
    return c if c < prompt_tokens else prompt_tokens - 1


def best_prefill(snap: ClusterSnapshot, model: LatencyModel, params: PolicyParams,
                 include_kv: bool = False, kv_tokens: int | None = None) -> tuple[str, float, float | None]:
    """Prefill node with the lowest TTFT_pf (Eq. 1), that TTFT in ms, and the KV estimate.

    With ``include_kv`` (kairos+) TTFT_pf also counts the node's queued KV-transfer work
    (``kv_backlog_ms``) plus this request's own transfer time on the profile's link. With
    ``params.model_correction`` (kairos+) the node's queue wait and prefill time (Eq. 2–3) are
    scaled by its learned ``step_bias``. With ``params.prefix_aware`` (kairos+) each node's Eq. 3
    computes only the tokens past its cached prefix (``cached_prefix_tokens``), and
    ``kv_tokens`` (the tokens the receiving decode node lacks; default ℓ) is what crosses the link.
    The third value is the request's own KV-transfer time (ms), reported by every policy.
    When no node's TTFT_pf is finite (estimates that overflow), the node listed first is returned
    with an infinite TTFT: never no node (issue 32: ``pd`` kept a request on node ``''``).
    """
    ell = snap.request.prompt_tokens
    chi_p = params.prefill_chunk_tokens
    exec_ms = prefill_exec_ms(model, ell, chi_p)
    kv_ms = float(model.kv_transfer_ms(ell if kv_tokens is None else kv_tokens, params.link))
    aware = params.prefix_aware
    best_id, best_ms = snap.prefill_nodes[0].id, float("inf")
    for pn in snap.prefill_nodes:
        if aware and pn.cached_prefix_tokens:
            t = prefill_queue_wait_ms(model, pn.queue_prompt_tokens, chi_p) + prefill_exec_ms(
                model, ell, chi_p, request_hit(pn, ell))
        else:
            t = prefill_queue_wait_ms(model, pn.queue_prompt_tokens, chi_p) + exec_ms
        if params.model_correction:
            t *= pn.step_bias
        if include_kv:
            t += pn.kv_backlog_ms + kv_ms
        if t < best_ms:
            best_id, best_ms = pn.id, t
    return best_id, best_ms, kv_ms


def keep_receiver(snap: ClusterSnapshot, prefix_aware: bool) -> tuple[str, int]:
    """Decode node receiving the KV of a keep-path request, and the prompt tokens it already holds.

    Prefix-aware (kairos+, dynamo): the node holding the longest cached prefix of the request
    (fewest blocks to transfer, session affinity as Dynamo's KV router), ties by
    :func:`least_loaded_decode`'s order and tie-break; else the least-loaded node (hit 0).
    """
    if not prefix_aware:
        return least_loaded_decode(snap), 0
    ell = snap.request.prompt_tokens
    dn = min_spread(snap.decode_nodes, lambda d: (-d.cached_prefix_tokens, d.kv_tokens, d.batch_size, d.waiting),
                    snap.request.id)
    return dn.id, request_hit(dn, ell)


_LOAD = attrgetter("kv_tokens", "batch_size", "waiting")  # C-level key: O(nodes) per keep decision

_N = TypeVar("_N")


def tie_index(request_id: str, ties: int) -> int:
    """Which of ``ties`` equally good nodes (in listed order) ``request_id`` takes: a stable hash
    of the id (CRC-32, the same in every replica and the simulator) modulo ``ties``."""
    return zlib.crc32(request_id.encode()) % ties if ties > 1 else 0


def min_spread(nodes: Sequence[_N], key: Callable[[_N], object], request_id: str) -> _N:
    """The node with the smallest ``key``; exact ties are broken by :func:`tie_index` of the
    request, so replicas deciding within the same few ms on the same state spread a burst."""
    best = min(map(key, nodes))  # type: ignore[type-var]
    ties = [n for n in nodes if key(n) == best]
    return ties[tie_index(request_id, len(ties))]


def least_loaded_decode(snap: ClusterSnapshot) -> str:
    """Decode node that receives the KV of a keep-path request: fewest cached KV tokens, then
    smallest batch, then fewest waiting admissions; exact ties go to the tied node picked by a
    hash of the request id (:func:`tie_index`), so simultaneous decisions on the same state spread."""
    return min_spread(snap.decode_nodes, _LOAD, snap.request.id).id


def deflect_target(snap: ClusterSnapshot) -> str:
    """Decode node for the static policies' deflections: one without a deflection in flight if
    any, then least loaded (static policies do not model TBT, §3.4)."""
    return min(snap.decode_nodes,
               key=lambda d: (d.deflection_in_flight or bool(d.in_flight), d.kv_tokens, d.batch_size)).id
