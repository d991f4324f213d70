"""Chat prompts counted with the served model's tokenizer and chat template (tool calls included)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from kairos.services.ingress import openai_api as oa

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'system' and not loop.first %}{{ raise_exception('system message must be first') }}{% endif %}"
    "[{{ m.role }}] {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture()
def model_dir(tmp_path):
    words = ["<unk>", "<s>", "</s>", "[", "]", "user", "assistant", "tool", "system", "hi", "CALL", "get_weather",
             "{", "}", "\"", ":", "city", "Paris", "sunny"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace()])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False}}))
    return tmp_path


def prepare(model_dir, body, max_model_len=10_000):
    counter, vocab = oa.load_tokenizer(str(model_dir / "tokenizer.json"))
    tpl = oa.load_chat_template(str(model_dir))
    assert tpl is not None
    return oa.prepare_request("chat", {"model": "m", **body}, ["m"], counter, max_model_len, vocab_size=vocab,
                              chat_template=tpl)


def test_prompt_is_rendered_with_the_model_template_and_counted_by_its_tokenizer(model_dir):
    p, n, exact = prepare(model_dir, {"messages": [{"role": "user", "content": "hi"}]})
    assert p.prompt_text == "<s>[user] hi</s>\n[assistant]"
    assert exact and n == len(Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(
        p.prompt_text, add_special_tokens=False).ids)


def test_tool_calls_are_rendered_as_objects_and_counted(model_dir):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    p, n, _ = prepare(model_dir, {"messages": msgs, "max_tokens": 1})
    assert 'CALL get_weather {"city": "Paris"}' in p.prompt_text
    _, n0, _ = prepare(model_dir, {"messages": [msgs[0], {"role": "assistant", "content": ""}, msgs[2]],
                                   "max_tokens": 1})
    assert n > n0 + 5


def test_template_errors_are_400s_naming_messages(model_dir):
    with pytest.raises(oa.ApiError) as ei:
        prepare(model_dir, {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "x"}]})
    assert ei.value.status == 400 and ei.value.param == "messages" and "system message must be first" in ei.value.message


def test_the_tokenizer_vocabulary_bounds_token_ids(model_dir):
    counter, vocab = oa.load_tokenizer(str(model_dir / "tokenizer.json"))
    assert vocab == 19
    with pytest.raises(oa.ApiError) as ei:
        oa.parse_request("completions", {"model": "m", "prompt": [19]}, ["m"], vocab_size=vocab)
    assert ei.value.param == "prompt"


def test_no_template_means_the_fixed_one(tmp_path):
    assert oa.load_chat_template(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default",
                                                                                   "template": "{{ messages[0].content }}"}]}))
    assert oa.load_chat_template(str(tmp_path))([{"role": "user", "content": "yo"}]) == "yo"
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    assert oa.load_chat_template(str(tmp_path))([{"role": "user", "content": "yo"}]) == "<user>"
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(ValueError):
        oa.load_chat_template(str(tmp_path))


def test_completion_text_counts_special_tokens_like_vllm(tmp_path):
    """vLLM tokenizes a completion prompt with add_special_tokens=True (BOS) and a chat prompt without."""
    from tokenizers import processors

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "hi": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    counter, _ = oa.load_tokenizer(str(tmp_path / "tokenizer.json"))
    comp = oa.parse_request("completions", {"model": "m", "prompt": "hi hi"}, ["m"])
    assert oa.count_prompt_tokens(comp, counter) == (3, True)  # <s> hi hi
    chat = oa.parse_request("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ["m"],
                            chat_template=lambda msgs: "<s> hi")
    assert oa.count_prompt_tokens(chat, counter) == (2, True)  # the template's <s>, no second BOS
