"""Deterministic output of the emulated engine: token ids from a fixed vocabulary, and vLLM's stop rules.

Where it is used: the node agent's emulated backend asks :func:`emulated_completion` for the
output of a request before handing it to the engine model, gives the engine ``n_tokens`` as the
output length, and streams ``text(i)`` for output token ``i``; the ``DoneEvent`` carries
``finish_reason``. No I/O, no randomness: the same request always produces the same output, so
``stop``, ``stop_token_ids``, ``min_tokens``, ``ignore_eos``, ``seed`` and ``finish_reason`` can
be tested without a real model.

The emulated model:

* **Vocabulary** of :data:`EMULATED_VOCAB_SIZE` ids. Ids 0, 1, 2 are the special tokens
  ``<unk>``, ``<s>``, ``</s>`` (:data:`EOS_TOKEN_ID` = 2, as in Llama-2 tokenizers); id ``t >= 3``
  is the word ``" " + WORDS[(t - 3) % len(WORDS)]``.
* **Sequence**: output token ``i`` is ``3 + mix(key, i) % (EMULATED_VOCAB_SIZE - 3)`` (never a
  special token), where ``key`` is the request's ``seed`` (when sampling: ``temperature`` unset or
  > 0), else a hash of the prompt (text or token ids) — so greedy requests (``temperature: 0``)
  depend on the prompt only, as with a real model. A token the request forbids at that index is
  re-drawn (``mix(key ^ salt_k, i)``, k = 1, 2, …): ids with ``logit_bias`` ≤ −100 always, and the
  ``stop_token_ids`` before ``min_tokens`` (vLLM masks their logits: ``MinTokensLogitsProcessor``).
* **EOS ("natural ending")**: a real model ends when it samples EOS; an emulated engine that did so
  on its own would change the output lengths of workload replays, which set ``max_tokens`` (and
  ``ignore_eos``, like ``vllm bench serve``) and must get exactly that many tokens for the
  simulator/live comparison. So the emulated EOS appears only when the request *asks for a natural
  ending*: it did not set ``max_tokens`` (``natural_end=True``; chat's default is the whole
  remaining context) and not ``ignore_eos``. It is then token ``max(natural_length(key), min_tokens
  + 1) − 1`` (``natural_length`` ∈ [16, 256]), or never if ``max_tokens`` comes first (or
  ``logit_bias`` bans EOS with −100).

Stop rules, as vLLM 0.32 applies them (``vllm/v1/core/sched/utils.py`` ``check_stop``,
``vllm/v1/engine/detokenizer.py``):

* after each token: EOS (unless ``ignore_eos``) or a ``stop_token_ids`` id → ``finish_reason``
  ``"stop"``; the stopping token counts in ``completion_tokens`` but its text is left out unless
  ``include_stop_str_in_output`` (EOS text is ``""`` with ``skip_special_tokens``, the default);
  else ``max_tokens`` reached → ``"length"``;
* stop strings are searched only in the text from output token ``min_tokens`` on; the first match
  ends the request with ``"stop"``, the text cut before the stop string (after it with
  ``include_stop_str_in_output``), and tokens after the one completing the match are dropped. A
  stop string spanning several tokens shortens the text of earlier tokens too (vLLM holds back
  ``len(stop) − 1`` characters while streaming for the same reason).
"""

from __future__ import annotations

import hashlib
from typing import Literal

from kairos.contracts.wire import SamplingParams

#: Vocabulary size of the emulated model (Llama-2's): token ids the ingress accepts are < this
#: unless a tokenizer is configured, whose size is used instead.
EMULATED_VOCAB_SIZE = 32000
#: The emulated model's special tokens (id -> text) and its EOS id.
SPECIAL_TOKENS = {0: "<unk>", 1: "<s>", 2: "</s>"}
EOS_TOKEN_ID = 2
#: Words of the non-special ids (id t >= 3 is " " + WORDS[(t - 3) % len(WORDS)]).
WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
         "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim")
#: Range of the natural length (tokens, EOS included) of a request that asks for a natural ending.
NATURAL_LENGTH_MIN, NATURAL_LENGTH_MAX = 16, 256

_MASK = (1 << 64) - 1
_FIRST_WORD_ID = len(SPECIAL_TOKENS)

FinishReason = Literal["stop", "length"]


def _mix(x: int) -> int:
    """splitmix64 finalizer: a 64-bit integer hash (deterministic across processes and runs)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def token_text(token_id: int, skip_special_tokens: bool = True) -> str:
    """Text of an emulated token id; special tokens are ``""`` when ``skip_special_tokens``.

    Raises:
        ValueError: ``token_id`` is negative.
    """
    if token_id < 0:
        raise ValueError(f"token id must be >= 0, got {token_id}")
    if token_id < _FIRST_WORD_ID:
        return "" if skip_special_tokens else SPECIAL_TOKENS[token_id]
    return " " + WORDS[(token_id - _FIRST_WORD_ID) % len(WORDS)]


def sequence_key(sampling: SamplingParams, prompt_text: str | None, prompt_token_ids: list[int] | None) -> int:
    """The key the token sequence is a function of: the seed when sampling with one, else the prompt."""
    if sampling.seed is not None and (sampling.temperature is None or sampling.temperature > 0):
        return _mix(sampling.seed & _MASK)
    h = hashlib.blake2b(digest_size=8)
    if prompt_token_ids is not None:
        h.update(b"ids:" + ",".join(map(str, prompt_token_ids)).encode())
    else:
        h.update(b"text:" + (prompt_text or "").encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def natural_length(key: int) -> int:
    """Output tokens (EOS included) of a request that asks for a natural ending, in [16, 256]."""
    return NATURAL_LENGTH_MIN + _mix(key ^ 0x5EED) % (NATURAL_LENGTH_MAX - NATURAL_LENGTH_MIN + 1)


class EmulatedCompletion:
    """The emulated output of one request (see the module docstring for the rules).

    Args:
        sampling: the request's sampling parameters (validated by the ingress).
        max_tokens: the output limit (≥ 1).
        key: :func:`sequence_key` of the request.
        natural_end: the request asks for a natural ending (it did not set ``max_tokens``).
        vocab_size: ids are drawn from ``[3, vocab_size)``.

    Attributes:
        n_tokens: output tokens generated (``completion_tokens``), 1 ≤ n_tokens ≤ max_tokens.
        finish_reason: ``"stop"`` or ``"length"``.
        stop_reason: the stop string or stop token id that ended it (EOS: None), or None.

    Raises:
        ValueError: ``max_tokens`` < 1 or ``vocab_size`` ≤ 3.

    Cost: O(1) without stop conditions; else O(tokens generated) (every token is checked).
    """

    def __init__(self, sampling: SamplingParams, max_tokens: int, key: int, natural_end: bool = False,
                 vocab_size: int = EMULATED_VOCAB_SIZE) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if vocab_size <= _FIRST_WORD_ID:
            raise ValueError(f"vocab_size must be > {_FIRST_WORD_ID}, got {vocab_size}")
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.key = key
        self._words = vocab_size - _FIRST_WORD_ID
        self._min = sampling.min_tokens or 0
        self._stop_ids = frozenset(sampling.stop_token_ids or ())
        self._banned = frozenset(int(t) for t, b in (sampling.logit_bias or {}).items() if b <= -100)
        self._skip_special = sampling.skip_special_tokens is not False
        self._include_stop = bool(sampling.include_stop_str_in_output)
        self.eos_index: int | None = None
        if natural_end and not sampling.ignore_eos and EOS_TOKEN_ID not in self._banned:
            self.eos_index = max(natural_length(key) - 1, self._min)
        self._texts: dict[int, str] = {}  # token index -> delta text, where it differs from token_text
        self.stop_reason: str | int | None = None
        self.n_tokens, self.finish_reason = self._plan()

    def token_id(self, i: int) -> int:
        """Output token ``i``'s id (0-based), whether or not the request generates that many."""
        if i == self.eos_index:
            return EOS_TOKEN_ID
        salt = 0
        while True:
            t = _FIRST_WORD_ID + _mix(self.key ^ (salt * 0xD1B54A32D192ED03) ^ (i * 0x9E3779B97F4A7C15)) % self._words
            if t not in self._banned and not (i < self._min and t in self._stop_ids):
                return t
            salt += 1
            if salt > 64:  # every id banned (cannot happen with a validated logit_bias): keep the last draw
                return t

    def text(self, i: int) -> str:
        """The text delta of output token ``i`` (``0 <= i < n_tokens``); may be ``""``."""
        if i in self._texts:
            return self._texts[i]
        return token_text(self.token_id(i), self._skip_special)

    def full_text(self) -> str:
        """The whole output text (the concatenation of ``text(i)``)."""
        return "".join(self.text(i) for i in range(self.n_tokens))

    def _plan(self) -> tuple[int, FinishReason]:
        stops = [s for s in (self.sampling.stop or ()) if s]
        if not stops and not self._stop_ids and self.eos_index is None:
            return self.max_tokens, "length"  # nothing can end it early: no scan
        text = ""
        starts: list[int] = []  # char offset of each token's text in ``text``
        for i in range(self.max_tokens):
            t = self.token_id(i)
            starts.append(len(text))
            if t == EOS_TOKEN_ID and i == self.eos_index or t in self._stop_ids:
                if t != EOS_TOKEN_ID:
                    self.stop_reason = t
                self._texts[i] = token_text(t, self._skip_special) if self._include_stop else ""
                return i + 1, "stop"
            piece = token_text(t, self._skip_special)
            text += piece
            if stops and i + 1 > self._min:  # one token per step: the new text starts at starts[i]
                hit = self._find_stop(text, starts[i], stops)
                if hit is not None:
                    at, s = hit
                    end = at + len(s) if self._include_stop else at
                    self.stop_reason = s
                    for j in range(i + 1):  # re-cut every token's delta to the truncated text
                        lo, hi = starts[j], (starts[j + 1] if j + 1 <= i else len(text))
                        cut = text[min(lo, end):min(hi, end)]
                        if cut != token_text(self.token_id(j), self._skip_special):
                            self._texts[j] = cut
                    return i + 1, "stop"
        return self.max_tokens, "length"

    @staticmethod
    def _find_stop(text: str, new_from: int, stops: list[str]) -> tuple[int, str] | None:
        """vLLM's ``check_stop_strings``: the first stop string *in list order* found in the new text
        (from ``new_from``, or up to ``len(stop) - 1`` characters before it so a match may straddle)."""
        for s in stops:
            at = text.find(s, max(0, new_from - len(s) + 1))
            if at >= 0:
                return at, s
        return None


class ResumedCompletion:
    """The rest of an :class:`EmulatedCompletion` after its first ``offset`` tokens: what the emulated
    engine generates for a migrated request (issue 33, ``InferenceRequest.resume``) — the tokens the
    original would have produced at those positions, so a stream continued on another node is the
    uninterrupted one (its stop strings included: they were planned on the whole text).

    Raises:
        ValueError: ``offset`` is not inside the output (0 < offset < ``full.n_tokens``): the
            original ended there already.
    """

    def __init__(self, full: EmulatedCompletion, offset: int) -> None:
        if not 0 < offset < full.n_tokens:
            raise ValueError(f"cannot resume after {offset} output tokens: the output has {full.n_tokens}")
        self.full, self.offset = full, offset
        self.n_tokens = full.n_tokens - offset
        self.finish_reason, self.stop_reason = full.finish_reason, full.stop_reason

    def token_id(self, i: int) -> int:
        return self.full.token_id(self.offset + i)

    def text(self, i: int) -> str:
        return self.full.text(self.offset + i)


def emulated_completion(sampling: SamplingParams, max_tokens: int, prompt_text: str | None,
                        prompt_token_ids: list[int] | None, natural_end: bool = False,
                        vocab_size: int = EMULATED_VOCAB_SIZE) -> EmulatedCompletion:
    """:class:`EmulatedCompletion` of a request, keyed by :func:`sequence_key`."""
    return EmulatedCompletion(sampling, max_tokens, sequence_key(sampling, prompt_text, prompt_token_ids),
                              natural_end, vocab_size)
