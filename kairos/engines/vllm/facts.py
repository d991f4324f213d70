"""What a latency profile of a vLLM engine records about it (``kairos profile --vllm``, ``--testbed``).

:data:`VLLM_ENGINE_LABEL` names the engine an artifact measured, :func:`model_card` the model it ran
(its ``config.json`` architecture), :func:`measured_engine_facts` the engine facts such a run
measured instead of taking them from the base profile (KV bytes per token, KV capacity). The
profiler records them in the artifact's metadata (``kairos.services.profiler.session``,
``kairos/cli/testbed_profile.py``; docs/calibration.md).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kairos.core.model.latency import LatencyModel
from kairos.engines.vllm.launch import SCHEDULER_CLS, VLLM_VERSION

#: what a ``--vllm`` artifact's ``engine`` says it measured
VLLM_ENGINE_LABEL = f"vLLM-CPU {VLLM_VERSION} ({SCHEDULER_CLS}, --dtype float32, --enforce-eager)"

#: bytes per element of the KV cache of ``--dtype float32`` (the only dtype vLLM-CPU serves here)
KV_DTYPE_BYTES = 4

#: the ``config.json`` fields :func:`model_card` keeps (those present)
CARD_FIELDS = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "torch_dtype")


def model_card(model_dir: str) -> dict:
    """What a model directory holds, for the artifact's provenance: its ``config.json`` architecture
    fields (:data:`CARD_FIELDS`, those present) and the tiny model's seed/fingerprint
    (``kairos-tiny-model.json``, :mod:`kairos.engines.vllm.tiny_model`), if any; ``dir`` is the
    directory's name. A file that is missing or not JSON is left out (never raises)."""
    card: dict = {"dir": Path(model_dir).name}
    for name, pick in (("config.json", CARD_FIELDS), ("kairos-tiny-model.json", None)):
        try:
            doc = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        card.update({k: v for k, v in doc.items() if pick is None or k in pick})
    return card


def measured_engine_facts(base: LatencyModel, card: dict | None, idle_free_kv_tokens: int | None) -> LatencyModel:
    """``base`` with the engine facts a ``--vllm`` run measured instead of the base profile's:
    KV bytes per token from the model's architecture (``card``, :func:`model_card`; K and V:
    ``2 · layers · KV heads · head_dim ·`` :data:`KV_DTYPE_BYTES`) and the KV capacity (tokens)
    from the idle engine's free KV (its heartbeat's ``free_kv_tokens``). A fact the run did not
    measure keeps the base's value."""
    out = base
    keys = ("num_hidden_layers", "num_key_value_heads", "head_dim")
    if card and all(isinstance(card.get(k), int) for k in keys):
        per_token = 2 * card["num_hidden_layers"] * card["num_key_value_heads"] * card["head_dim"] * KV_DTYPE_BYTES
        out = replace(out, kv_bytes_per_token=float(per_token))
    if idle_free_kv_tokens:
        out = replace(out, engine=replace(out.engine, kv_capacity_tokens=int(idle_free_kv_tokens)))
    return out
