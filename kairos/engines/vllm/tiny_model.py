"""A tiny Llama with real random weights and a word-level tokenizer, generated locally (no download).

    python -m kairos.engines.vllm.tiny_model DIR [--seed N] [--size tiny|testbed]      # write the model directory DIR
    python -m kairos.engines.vllm.tiny_model --cached [--seed N] [--size tiny|testbed]  # ensure ~/.cache/kairos/<size>-llama-<hash>

Runs in the vLLM virtualenv (torch + transformers + tokenizers). The model (:data:`SIZES`):
``LlamaForCausalLM``, ``tiny`` (the tests' model): hidden 256, 2 layers, 4 query heads / 2 KV heads
of dim 64, MLP 512; ``testbed`` (``kairos demo --engine vllm``, the ``cpu-testbed-vllm`` profile):
hidden 512, 4 layers, 8 query / 4 KV heads of dim 64, MLP 1536, large enough that a step's compute,
not vLLM's Python overhead, dominates on one core. Both: vocab 1024, context 2048,
float32 weights drawn from a fixed seed (``initializer_range`` 0.1 so greedy outputs vary),
saved as ``model.safetensors`` (~9 MB). Same seed → same weights (bit-identical on one torch
build), so a greedy request gives the same text on any server loading the directory.

The tokenizer (``tokenizer.json``, loadable by the ``tokenizers`` library alone — the ingress
uses that) is word-level: lower-cased, split on whitespace and punctuation (numbers into digits), one id per
word, unknown words → ``<unk>``.
Ids 0–6 are ``<unk> <s> </s> <pad> <|system|> <|user|> <|assistant|>``; then punctuation,
digits, letters, common English words, and ``w<id>`` fillers up to 1024, so every id in
``[1, 1000]`` (``kairos bench``'s token-id prompts) is a valid token. ``tokenizer_config.json``
carries the chat template of :func:`kairos.services.ingress.openai_api.render_chat` (``<|role|>\\ncontent\\n`` …
``<|assistant|>\\n``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import string
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 1024
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
UNK, BOS, EOS, PAD = 0, 1, 2, 3
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORDS = """
the of and to a in is it you that he was for on are with as i his they be at one have this from or
had by hot word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing
see him two has look more day could go come did number sound no most people my over know water than
call first who may down side been now find any new work part take get place made live where after
back little only round man year came show every good me give our under name very through just form
sentence great think say help low line differ turn cause much mean before move right boy old too
same tell does set three want air well also play small end put home read hand port large spell add
even land here must big high such follow act why ask men change went light kind off need house
picture try us again animal point mother world near build self earth father head stand own page
should country found answer school grow study still learn plant cover food sun four between state
keep eye never last let thought city tree cross farm hard start might story saw far sea draw left
late run while press close night real life few north open seem together next white children begin
got walk example ease paper group always music those both mark often letter until mile river car
feet care second book carry took science eat room friend began idea fish mountain stop once base
hear horse cut sure watch color face wood main enough plain girl usual young ready above ever red
list though feel talk bird soon body dog family direct pose leave song measure door product black
short numeral class wind question happen complete ship area half rock order fire south problem
piece told knew pass since top whole king space heard best hour better true during hundred five
remember step early hold west ground interest reach fast verb sing listen six table travel less
morning ten simple several vowel toward war lay against pattern slow center love person money serve
appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead
cry dark machine note wait plan figure star box noun field rest correct able pound done beauty
drive stood contain front teach week final gave green oh quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full force
blue object decide surface deep moon island foot system busy test record boat common gold possible
plane stead dry wonder laugh thousand ago ran check game shape equate miss brought heat snow tire
bring yes distant fill east paint language among hello model token request server engine prefill
decode cache queue batch chunk latency
""".split()


def vocab() -> dict[str, int]:
    """Token → id, exactly :data:`VOCAB_SIZE` entries (see the module docstring)."""
    toks: list[str] = list(SPECIALS)
    for t in list(string.punctuation) + list(string.digits) + list(string.ascii_lowercase) + WORDS:
        if t not in toks:
            toks.append(t)
    if len(toks) > VOCAB_SIZE:
        raise ValueError(f"{len(toks)} base tokens > VOCAB_SIZE {VOCAB_SIZE}")
    toks += [f"w{i}" for i in range(len(toks), VOCAB_SIZE)]
    return {t: i for i, t in enumerate(toks)}


def build_tokenizer():
    """The word-level ``tokenizers.Tokenizer`` (lower-case, whitespace/punctuation split, no post-processor)."""
    from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel(vocab(), unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


#: model shapes by name (``--size``): LlamaConfig fields
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    "testbed": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
                "num_key_value_heads": 4},
}


def _size(size: str) -> dict[str, int]:
    try:
        return SIZES[size]
    except KeyError:
        raise ValueError(f"unknown model size {size!r}; known: {', '.join(SIZES)}") from None


def fingerprint(seed: int, size: str = "tiny") -> str:
    """Hash of this generator's source, the seed and the size: the cache directory's name changes with any."""
    src = Path(__file__).read_bytes()
    extra = "" if size == "tiny" else f"|size={size}"
    return hashlib.sha256(src + f"|seed={seed}{extra}".encode()).hexdigest()[:12]


def write_tokenizer_files(out_dir: str | os.PathLike) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template) and
    ``special_tokens_map.json`` into an existing directory (needs only ``tokenizers``)."""
    out = Path(out_dir)
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}, indent=1) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}, indent=1) + "\n")
    return out


def generate(out_dir: str | os.PathLike, seed: int = 0, size: str = "tiny") -> Path:
    """Write the model directory (config, ``model.safetensors``, tokenizer files) to ``out_dir``.

    Creates the directory (parents too); overwrites files of the same names. Returns the path.

    Raises:
        ValueError: ``size`` is not in :data:`SIZES`.
    """
    shape = _size(size)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, **shape, head_dim=64, max_position_embeddings=2048,
                         initializer_range=0.1, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, torch_dtype="float32")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer_files(out)
    (out / "kairos-tiny-model.json").write_text(json.dumps({"seed": seed, "size": size,
                                                                "fingerprint": fingerprint(seed, size)}) + "\n")
    out.chmod(0o755)
    for f in out.iterdir():
        f.chmod(0o644)
    return out


def cache_root() -> Path:
    """``$KAIROS_CACHE_DIR`` or ``~/.cache/kairos``."""
    return Path(os.environ.get("KAIROS_CACHE_DIR") or Path.home() / ".cache" / "kairos")


def ensure_cached(seed: int = 0, size: str = "tiny") -> Path:
    """The cached model directory ``<cache_root>/<size>-llama-<fingerprint>``, generated once.

    Generation writes into a temporary sibling and renames it into place, so concurrent callers
    and interrupted runs never see a half-written directory.
    """
    _size(size)
    root = cache_root()
    final = root / f"{size}-llama-{fingerprint(seed, size)}"
    if (final / "kairos-tiny-model.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=root))
    try:
        generate(tmp, seed, size)
        try:
            tmp.rename(final)
        except OSError:  # another process won the race
            if not (final / "kairos-tiny-model.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kairos.engines.vllm.tiny_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    ap.add_argument("--cached", action="store_true", help="generate into the cache once and print the directory")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model shape (default tiny)")
    a = ap.parse_args(argv)
    if bool(a.dir) == a.cached:
        ap.error("give exactly one of DIR or --cached")
    print(ensure_cached(a.seed, a.size) if a.cached else generate(a.dir, a.seed, a.size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
