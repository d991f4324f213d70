"""The tiny model generator (kairos.engines.vllm.tiny_model) under the vLLM venv: real, seeded weights and a
tokenizer/chat template that transformers (what vLLM uses) reads as the ingress does."""

from __future__ import annotations

import hashlib

import pytest

from tests.vllm.chat_example import CHAT_MSGS, CHAT_TEXT

pytestmark = pytest.mark.vllm


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_weights_are_seeded_and_real(tmp_path, tiny_model):
    from safetensors.numpy import load_file

    from kairos.engines.vllm.tiny_model import generate

    a, b, c = generate(tmp_path / "a", seed=0), generate(tmp_path / "b", seed=0), generate(tmp_path / "c", seed=1)
    assert digest(a / "model.safetensors") == digest(b / "model.safetensors")
    assert digest(a / "model.safetensors") != digest(c / "model.safetensors")
    w = load_file(str(a / "model.safetensors"))
    emb = w["model.embed_tokens.weight"]
    assert emb.shape == (1024, 256) and emb.std() > 0.05  # random, not flat (--load-format dummy is flat)
    assert sum(v.nbytes for v in w.values()) < 20e6


def test_tokenizer_and_chat_template_through_transformers(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert tok.apply_chat_template(CHAT_MSGS, tokenize=False, add_generation_prompt=True) == CHAT_TEXT
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 3)
    assert tok("hello there", add_special_tokens=False).input_ids == [tok.convert_tokens_to_ids(t) for t in ("hello", "there")]
