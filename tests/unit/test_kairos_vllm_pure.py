"""kairos.engines.vllm.plugin's vLLM-free parts: chunk-schedule arithmetic, the tiny model's tokenizer, the pin."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kairos.engines.vllm.plugin import VLLM_VERSION
from kairos.engines.vllm.plugin.chunks import ChunkScheduleError, chunk_position, kairos_request_id, parse_chunks, prefill_cap
from kairos.engines.vllm.tiny_model import SPECIALS, VOCAB_SIZE, build_tokenizer, write_tokenizer_files
from kairos.services.ingress.openai_api import load_chat_template, load_tokenizer, render_chat, tokenizer_counter
from tests.vllm.chat_example import CHAT_MSGS, CHAT_TEXT  # tests/vllm/inproc checks the tiny model's template

ROOT = Path(__file__).resolve().parents[2]


def test_parse_chunks_accepts_lists_and_refuses_bad_values():
    assert parse_chunks(None) is None and parse_chunks({"kairos_rid": "x"}) is None
    assert parse_chunks({"kairos_prefill_chunks": [32, 100]}) == (32, 100)
    for bad in ([], [0], [5, -1], [1.5], [True], "64", None, {"a": 1}):
        with pytest.raises(ChunkScheduleError, match="kairos_prefill_chunks"):
            parse_chunks({"kairos_prefill_chunks": bad})


def test_request_id_prefers_the_kairos_id():
    assert kairos_request_id({"kairos_rid": "cmpl-1"}, "cmpl-1-ab12cd34") == "cmpl-1"
    assert kairos_request_id(None, "v-1") == "v-1"
    assert kairos_request_id({"kairos_rid": 7}, "v-1") == "v-1"


def test_examples():
    # the last entry repeats: 300 = 32 + 100 + 64 + 64 + 40
    sched, done, sizes = [32, 100, 64], 0, []
    while (cap := prefill_cap(sched, done, 300)) is not None:
        n = min(cap, 300 - done)
        sizes.append(n)
        done += n
    assert sizes == [32, 100, 64, 64, 40]
    assert chunk_position(sched, 0) == (0, 32) and chunk_position(sched, 32) == (1, 132)
    assert chunk_position(sched, 300) == (4, 324)
    assert prefill_cap([100], 256, 400) == 44  # a prefix hit of 256 lands inside chunk 2
    assert prefill_cap([100], 400, 400) is None  # prompt done: decoding is never capped


@given(st.lists(st.integers(1, 300), min_size=1, max_size=6), st.integers(0, 5000))
def test_cap_reaches_exactly_the_next_boundary(chunks, computed):
    bounds = list(itertools.islice(itertools.accumulate(itertools.chain(chunks, itertools.repeat(chunks[-1]))),
                                   len(chunks) + computed + 2))
    k, end = chunk_position(chunks, computed)
    nxt = next(i for i, b in enumerate(bounds) if b > computed)
    assert (k, end) == (nxt, bounds[nxt])
    cap = prefill_cap(chunks, computed, computed + 1 + 10_000)
    assert cap == bounds[nxt] - computed >= 1


def test_tokenizer_loads_with_tokenizers_alone(tmp_path):
    tok = build_tokenizer()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    count = tokenizer_counter(str(path))  # the ingress's loader (tokenizers only)
    assert tok.get_vocab_size() == VOCAB_SIZE
    assert tok.encode("Hello, world! The engine decode 42", add_special_tokens=False).tokens == [
        "hello", ",", "world", "!", "the", "engine", "decode", "4", "2"]
    assert count("Hello, world! The engine decode 42") == 9
    assert tok.encode("xyzzy", add_special_tokens=False).tokens == ["<unk>"]
    enc = tok.encode("<|user|>\nhello\n<|assistant|>\n", add_special_tokens=False)
    assert enc.tokens == ["<|user|>", "hello", "<|assistant|>"]
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    assert all(tok.id_to_token(i) is not None for i in range(1, 1001))  # kairos bench's token-id prompts


def test_ingress_loads_the_tiny_model_tokenizer_and_chat_template(tmp_path):
    write_tokenizer_files(tmp_path)
    render = load_chat_template(str(tmp_path))  # the ingress's loader, as transformers renders
    assert render is not None and render(CHAT_MSGS) == CHAT_TEXT == render_chat(CHAT_MSGS)
    count, vocab = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert vocab == VOCAB_SIZE
    assert count("hello there", add_special_tokens=True) == 2  # no BOS post-processor: vLLM counts 2 too


def test_makefile_pins_the_plugin_version():
    m = re.search(r"^VLLM_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m and m.group(1) == VLLM_VERSION
