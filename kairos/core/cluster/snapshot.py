"""Policy input: one request and the cluster state a dispatcher sees (Algorithm 1's "Input").

Where it comes from: ``kairos decide`` reads it from JSON; the dispatcher builds it from the
state aggregator's cluster view; the simulator builds it from its engine models every heartbeat.
Where it goes: :func:`kairos.core.policy.decide`.

Structs are msgspec so that decoding validates types and bounds and names the offending field
(``$.decode_nodes[0].kv_tokens``). Unknown fields are refused (a typo such as
``deflection_in_flght`` would otherwise silently change the decision).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

#: Token counts are bounded so that nonsense (1e23 tokens) is rejected instead of producing
#: overflowing estimates: 10^9 tokens per request, 10^12 tokens of KV per node.
MAX_TOKENS_PER_REQUEST = 1_000_000_000
MAX_KV_TOKENS = 1_000_000_000_000
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS_PER_REQUEST)]
PosInt = Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS_PER_REQUEST)]
KvTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_KV_TOKENS)]
BatchSize = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]
NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
#: a learned multiplicative correction of the latency model (kairos/core/model/correction.py bounds it)
Factor = Annotated[float, msgspec.Meta(gt=0, le=100)]


class SnapshotError(ValueError):
    """A snapshot is malformed. The message names the offending field (JSON path)."""


class RequestView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The request being routed."""

    id: Annotated[str, msgspec.Meta(min_length=1)]  #: request id
    prompt_tokens: PosInt  #: ℓ_r, prompt length in tokens
    output_tokens: NonNegInt | None = None  #: max_tokens if known (not used by Algorithm 1)


class PrefillNodeView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """State of one prefill node (§4.2 input)."""

    id: NodeId
    #: [ℓ_1..ℓ_k]: prefill tokens still to compute for each request ahead of a new arrival on this
    #: node, FIFO order, the request in execution first (its remaining tokens only).
    queue_prompt_tokens: list[NonNegInt] = []
    #: KV-transfer work queued on this node's outgoing links, in ms (kairos+ only; 0 if unknown).
    kv_backlog_ms: Annotated[float, msgspec.Meta(ge=0, le=1e9)] = 0.0
    #: learned mean actual/predicted step time of this node (kairos+ model correction; 1 = none)
    step_bias: Factor = 1.0
    #: leading prompt tokens of the routed request this node holds in its prefix cache (the view's
    #: prefix index, kairos/core/cluster/prefix_index.py; 0 = none or unknown). Read by cache-aware policies only.
    cached_prefix_tokens: NonNegInt = 0


class InFlightDeflection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A deflected prefill still running on a decode node (used by kairos+ state projection)."""

    prompt_tokens: NonNegInt  #: prefill tokens not yet computed
    output_tokens: NonNegInt = 0  #: max output tokens of that request (0 if unknown)


class DecodeNodeView(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """State of one decode node (§4.3 input)."""

    id: NodeId
    batch_size: BatchSize  #: B_n, running decode requests
    kv_tokens: KvTokens  #: K_n, cached KV tokens of those decodes, summed
    #: True while a deflection dispatched to this node has not finished its prefill (§5.3, §7).
    deflection_in_flight: bool = False
    #: Deflections dispatched but not yet reflected in (B_n, K_n) (kairos+ projection).
    in_flight: list[InFlightDeflection] = []
    #: Requests waiting for admission (KV handoffs not yet running), informational.
    waiting: BatchSize = 0
    #: learned mean actual/predicted step time of this node (kairos+ model correction; 1 = none)
    step_bias: Factor = 1.0
    #: learned upper bound of actual/predicted: Eq. 5 checks T·step_safety ≤ β·τ (kairos+)
    step_safety: Factor = 1.0
    #: leading prompt tokens of the routed request this node holds in its prefix cache (the view's
    #: prefix index, kairos/core/cluster/prefix_index.py; 0 = none or unknown). Read by cache-aware policies only.
    cached_prefix_tokens: NonNegInt = 0


class ClusterSnapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One policy input: the request plus every routable node."""

    request: RequestView
    prefill_nodes: Annotated[list[PrefillNodeView], msgspec.Meta(min_length=1)]
    decode_nodes: Annotated[list[DecodeNodeView], msgspec.Meta(min_length=1)]
    #: age of the state the snapshot was built from, ms (informational; the dispatcher records it)
    state_age_ms: Annotated[float, msgspec.Meta(ge=0, le=1e12)] | None = None


_decoder = msgspec.json.Decoder(ClusterSnapshot)


def parse_snapshot(data: bytes | str) -> ClusterSnapshot:
    """Decode and validate a snapshot from JSON.

    Raises:
        SnapshotError: invalid JSON, a missing or mistyped field, a negative token count, an empty
            node list or a duplicated node id. The message names the field.
    """
    try:
        snap = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise SnapshotError(f"invalid snapshot: {exc}") from None
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"snapshot is not valid JSON: {exc}") from None
    validate_snapshot(snap)
    return snap


def validate_snapshot(snap: ClusterSnapshot) -> None:
    """Cross-field checks that types alone cannot express.

    Raises:
        SnapshotError: a node id appears twice (the path of the second occurrence is named).
    """
    seen: set[str] = set()
    for kind, nodes in (("prefill_nodes", snap.prefill_nodes), ("decode_nodes", snap.decode_nodes)):
        for i, n in enumerate(nodes):
            if n.id in seen:
                raise SnapshotError(f"invalid snapshot: duplicate node id {n.id!r} - at `$.{kind}[{i}].id`")
            seen.add(n.id)
