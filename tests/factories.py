"""Test builders: latency models with hand-checkable numbers and snapshot factories."""

from __future__ import annotations

from kairos.core.model.latency import EngineLimits, LatencyModel, LinkModel
from kairos.core.cluster.snapshot import ClusterSnapshot, DecodeNodeView, PrefillNodeView, RequestView


def tiny_model(**overrides) -> LatencyModel:
    """A model whose numbers can be checked by hand.

    prefill: T = 10 + 0.1·n + 0.0001·n·c ms; decode: T0 = 20 + 1·B + 0.001·K ms;
    mixed ΔT = p·(0.1 + 0·p + 0.001·c + 0·K) ms; link: 1 ms + tokens·1000 B / 1 GB/s.
    """
    fields = dict(
        name="tiny", version="test",
        prefill_intercept_ms=10.0, prefill_coef=(0.1, 0.0001),
        decode_intercept_ms=20.0, decode_coef=(1.0, 0.001),
        mixed_delta_coef=(0.1, 0.0, 0.001, 0.0),
        kv_bytes_per_token=1000.0,
        links={"l": LinkModel(bandwidth_gb_s=1.0, setup_ms=1.0)}, default_link="l",
        engine=EngineLimits(max_num_seqs=64, max_num_batched_tokens=100, decode_max_num_batched_tokens=100,
                            kv_capacity_tokens=100_000, block_size=16, max_model_len=32_768),
    )
    fields.update(overrides)
    return LatencyModel(**fields)


def snapshot(prompt: int, prefill_queues: list[list[int]], decodes: list[tuple[int, int, bool]],
             request_id: str = "r1") -> ClusterSnapshot:
    """Snapshot with prefill nodes ``prefill-i`` (queues) and decode nodes ``decode-i`` (B, K, in-flight)."""
    return ClusterSnapshot(
        request=RequestView(id=request_id, prompt_tokens=prompt),
        prefill_nodes=[PrefillNodeView(id=f"prefill-{i}", queue_prompt_tokens=q) for i, q in enumerate(prefill_queues)],
        decode_nodes=[DecodeNodeView(id=f"decode-{i}", batch_size=b, kv_tokens=k, deflection_in_flight=f)
                      for i, (b, k, f) in enumerate(decodes)],
    )
