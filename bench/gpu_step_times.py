"""Step times of a real transformer on one GPU (PyTorch + transformers only), and the Kairos step model fitted to them.

What is measured: one engine step of a random-weight ``LlamaForCausalLM`` built from a config in code (default
``llama-3-8b``: Llama-3-8B's architecture, bfloat16; nothing is downloaded) carrying ``p`` prompt tokens of one
request whose first ``c`` prompt tokens are already in its KV cache, plus ``B`` single-token decodes with ``ctx``
cached tokens each (``K = B·ctx``). Like vLLM's V1 model runner, the step is *one packed forward*: embeddings,
QKV/O projections, MLPs and norms run once over all ``p + B`` tokens; logits and a greedy pick are computed for
the chunk's last token and each decode. Attention per layer is two ``scaled_dot_product_attention`` calls:
the chunk's ``p`` queries over its ``c + p`` keys with a lower-right causal mask, and the ``B`` decode queries
over their ``ctx + 1`` keys (GQA by grouping the query heads per KV head). :func:`check_against_transformers`
proves, at the start of every run, that this step computes the same logits as transformers' own forward.

How it differs from vLLM (its FlashAttention backend over a paged KV cache): KV lives in one contiguous tensor
per request group (chunk; decode batch, all decodes of equal context) instead of blocks read through a block
table, so there is no paged-gather cost; attention is two kernel launches per layer instead of one varlen
launch; the new tokens' KV is written by slice copy (vLLM: ``reshape_and_cache_flash``); eager PyTorch, no
CUDA graphs and no torch.compile, so small steps include kernel-launch overhead vLLM's graphs remove; no
sampler beyond argmax, no scheduler or detokenizer time.

Timing: per grid point (``B``, ``ctx``, ``p``, ``c``) the inputs and caches are built, ``--warmup`` steps
are run and discarded, then ``--repeats`` steps are timed (CUDA events, ``torch.cuda.synchronize``; on CPU
``time.perf_counter``); the row's ``latency_ms`` is their median. Points run decode-only and prefill-only
first, then mixed ones in a seeded random order until ``--budget-s`` (wall, model build included) is spent.
The fit is :func:`kairos.core.model.fitting.fit_latency_model` (the form of ``kairos profile``) over those rows: it holds
out a random 20 % of each kind (prefill-only, decode-only, mixed) and reports MAPE on those rows only.

Output: ``bench/results/gpu-step-times.jsonl`` (the result-file format of tools/docgen/docgen.py: a meta line, then
a ``config`` row, one ``step`` row per grid point, one ``fit`` row per kind). Run on a GPU host with the
repository's requirements plus torch and transformers::

    python bench/gpu_step_times.py --device cuda            # new points stop after --budget-s (default 420 s)
    python bench/gpu_step_times.py --device cpu --smoke --out /tmp/smoke.jsonl   # tiny model, seconds
    python bench/gpu_step_times.py --refit bench/results/gpu-step-times.jsonl   # refit recorded rows (no torch)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.docgen.docgen import load_result, result_meta, write_result  # noqa: E402

DEFAULT_OUT = ROOT / "bench" / "results" / "gpu-step-times.jsonl"
#: Model configs (transformers ``LlamaConfig`` fields). ``llama-3-8b`` is Meta-Llama-3-8B's config.json.
ARCHS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
                  rope_theta=10000.0),
}


@dataclass(frozen=True)
class Grid:
    """Grid of steps (token counts in tokens): decode batches B, context per decode ctx, chunk p, prefix c."""

    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    chunks: tuple[int, ...]
    prefixes: tuple[int, ...]

    def points(self, seed: int) -> list[tuple[int, int, int, int]]:
        """(B, ctx, p, c) of every step: decode-only (p = 0), prefill-only (B = 0), then mixed, shuffled."""
        dec = [(b, x, 0, 0) for b in self.batches for x in self.contexts]
        pf = [(0, 0, p, c) for p in self.chunks for c in self.prefixes]
        mix = [(b, x, p, c) for b in self.batches for x in self.contexts for p in self.chunks for c in self.prefixes]
        rng = random.Random(seed)
        for part in (dec, pf, mix):
            rng.shuffle(part)
        return dec + pf + mix


#: ``cuda``: B up to 128 (vLLM's usual decode batches), ctx up to 4,096, chunks up to 2,048 (a common
#: ``max_num_batched_tokens``), prefixes up to 4,096: 303 points, at most 64 GiB of decode KV for llama-3-8b
#: (with 16 GB of weights, within an H200's memory).
GRIDS = {"cuda": Grid((1, 4, 16, 32, 64, 128), (512, 2048, 4096), (64, 256, 512, 1024, 2048), (0, 1024, 4096)),
         "smoke": Grid((1, 2, 4), (8, 24), (4, 12, 20), (0, 8))}


def build_model(arch: str, device: str, dtype: Any) -> Any:
    """A random-weight ``LlamaForCausalLM`` of ``ARCHS[arch]`` on ``device`` in ``dtype``, eval mode (seed 0)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(ARCHS[arch])
    theta = spec.pop("rope_theta")
    cfg = LlamaConfig(**spec, rope_theta=theta, rope_parameters={"rope_type": "default", "rope_theta": theta},
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to(device=device, dtype=dtype).eval()


def kv_bytes_per_token(model: Any) -> int:
    """KV-cache bytes per token: layers × (K and V) × KV heads × head_dim × element size."""
    c = model.config
    return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * next(model.parameters()).element_size()


def alloc_cache(model: Any, seqs: int, length: int) -> list[tuple[Any, Any]]:
    """Per layer (K, V), each ``[seqs, kv_heads, length, head_dim]`` of random values on the model's device."""
    import torch

    c, w = model.config, next(model.parameters())
    new = lambda: torch.randn((seqs, c.num_key_value_heads, length, c.head_dim), device=w.device, dtype=w.dtype)
    return [(new(), new()) for _ in range(c.num_hidden_layers)]


@dataclass
class StepInputs:
    """One step: ``ids`` ``[p + b]`` (chunk tokens, then one per decode) at positions ``pos`` ``[p + b]``.

    ``pcache`` (per layer K, V ``[1, kvh, ≥ c + p, d]``: the chunk's request, ``c`` cached) and ``dcache``
    (``[b, kvh, ctx + 1, d]``: ``ctx`` cached per decode, the new token written at index ``ctx``).
    """

    ids: Any
    pos: Any
    p: int
    c: int
    pcache: list | None
    b: int
    ctx: int
    dcache: list | None


def make_inputs(model: Any, b: int, ctx: int, p: int, c: int, ids: Any = None) -> StepInputs:
    """Inputs and fresh random caches for a step of ``p`` chunk tokens after ``c`` plus ``b`` decodes of ``ctx``."""
    import torch

    dev = next(model.parameters()).device
    if ids is None:
        ids = torch.randint(0, model.config.vocab_size, (p + b,), device=dev)
    pos = torch.cat([torch.arange(c, c + p, device=dev), torch.full((b,), ctx, device=dev)])
    return StepInputs(ids, pos, p, c, alloc_cache(model, 1, c + p) if p else None, b, ctx,
                      alloc_cache(model, b, ctx + 1) if b else None)


def step_forward(model: Any, s: StepInputs) -> Any:
    """One packed forward pass; returns logits ``[(1 if p else 0) + b, vocab]`` (chunk's last token, then decodes).

    Writes the step's new K/V into ``s.pcache[:, :, c:c+p]`` and ``s.dcache[:, :, ctx]``. The layer is
    transformers' ``LlamaDecoderLayer.forward`` (modeling_llama.py) with its attention split by request.
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner, cfg = model.model, model.config
    nh, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g, p, c, b, ctx, t = nh // kvh, s.p, s.c, s.b, s.ctx, s.p + s.b
    h = inner.embed_tokens(s.ids)[None]
    cos, sin = inner.rotary_emb(h, s.pos[None])
    mask = causal_lower_right(p, c + p) if p else None
    for i, layer in enumerate(inner.layers):
        att = layer.self_attn
        x = layer.input_layernorm(h)
        q = att.q_proj(x).view(1, t, nh, d).transpose(1, 2)
        k = att.k_proj(x).view(1, t, kvh, d).transpose(1, 2)
        v = att.v_proj(x).view(1, t, kvh, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        outs = []
        if p:
            kc, vc = s.pcache[i]
            kc[:, :, c:c + p] = k[:, :, :p]
            vc[:, :, c:c + p] = v[:, :, :p]
            o = F.scaled_dot_product_attention(q[:, :, :p], kc[:, :, :c + p], vc[:, :, :c + p], attn_mask=mask,
                                               enable_gqa=g > 1)
            outs.append(o[0].transpose(0, 1).reshape(p, nh * d))
        if b:
            kd, vd = s.dcache[i]
            kd[:, :, ctx] = k[0, :, p:].transpose(0, 1)
            vd[:, :, ctx] = v[0, :, p:].transpose(0, 1)
            qd = q[0, :, p:].transpose(0, 1).reshape(b, kvh, g, d)  # head h reads KV head h // g (repeat_kv)
            outs.append(F.scaled_dot_product_attention(qd, kd, vd).reshape(b, nh * d))
        h = h + att.o_proj(torch.cat(outs)[None] if len(outs) > 1 else outs[0][None])
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = model.lm_head(inner.norm(h[0, torch.arange(p - 1 if p else p, t, device=h.device)]))
    logits.argmax(-1)  # the greedy pick of vLLM's sampler, for its cost
    return logits


def check_against_transformers(model: Any, *, c: int = 6, p: int = 5, b: int = 2, ctx: int = 7) -> float:
    """Relative max error of :func:`step_forward`'s logits against transformers' full forward of each sequence.

    Builds a chunk request (``c`` prefix tokens prefilled by a prefill-only step into its cache, then ``p``
    more in the mixed step) and ``b`` decodes (``ctx`` tokens each prefilled the same way, then one token),
    runs one mixed step and compares its ``1 + b`` logit rows with ``model(seq).logits[0, -1]``.
    Returns ``max |Δ| / max |reference|``; a wrong position, causal mask or KV-head grouping gives 3e-3 to 0.2
    on the smoke model in float32 (seen by breaking each), rounding alone 0 there.
    """
    import torch

    dev, vocab = next(model.parameters()).device, model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, vocab, (n,), generator=gen).to(dev) for n in [c + p] + [ctx + 1] * b]
    with torch.inference_mode():
        pcache = alloc_cache(model, 1, c + p)
        if c:
            step_forward(model, StepInputs(seqs[0][:c], torch.arange(c, device=dev), c, 0, pcache, 0, 0, None))
        dec = []
        for sq in seqs[1:]:
            dec.append(alloc_cache(model, 1, ctx + 1))
            step_forward(model, StepInputs(sq[:ctx], torch.arange(ctx, device=dev), ctx, 0, dec[-1], 0, 0, None))
        mixed = make_inputs(model, b, ctx, p, c, ids=torch.cat([seqs[0][c:]] + [sq[ctx:] for sq in seqs[1:]]))
        mixed.pcache, mixed.dcache = pcache, [(torch.cat([x[i][0] for x in dec]), torch.cat([x[i][1] for x in dec]))
                                              for i in range(model.config.num_hidden_layers)]
        got = step_forward(model, mixed).float()
        ref = torch.stack([model(input_ids=sq[None]).logits[0, -1] for sq in seqs]).float()
    return float((got - ref).abs().max() / ref.abs().max())


def time_point(model: Any, point: tuple[int, int, int, int], warmup: int, repeats: int) -> dict[str, Any]:
    """A ``step`` row: median/min/max ms of ``repeats`` timed steps after ``warmup`` discarded ones."""
    import torch

    b, ctx, p, c = point
    s = make_inputs(model, b, ctx, p, c)
    cuda = s.ids.is_cuda
    walls = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                step_forward(model, s)
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                step_forward(model, s)
                ms = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                walls.append(ms)
    kind = "prefill" if b == 0 else "decode" if p == 0 else "mixed"
    return {"row": "step", "kind": kind, "batch_size": b, "kv_tokens": b * ctx, "prefill_tokens": p,
            "prefill_cached": c, "context_per_decode": ctx, "latency_ms": round(statistics.median(walls), 4),
            "min_ms": round(min(walls), 4), "max_ms": round(max(walls), 4), "repeats": repeats}


def fit_rows(steps: list[dict[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Fit :func:`kairos.core.model.fitting.fit_latency_model` to ``step`` rows; one ``fit`` row per kind.

    Each row: ``kind``, ``samples`` (rows of that kind), ``heldout`` (rows the MAPE is computed on: the fit's
    random 20 %, never trained on), ``mape_heldout`` (percent), ``outliers_rejected`` (training rows, all kinds),
    and the fitted coefficients (ms per feature unit). Raises ValueError with fewer than 5 rows of a kind.
    """
    from kairos.core.model.fitting import StepRecord, fit_latency_model

    recs = [StepRecord(r["batch_size"], r["kv_tokens"], r["prefill_tokens"], r["prefill_cached"], r["latency_ms"])
            for r in steps]
    m = fit_latency_model(recs, name="gpu-step-times", version="fit", seed=seed)
    fit = m.metadata["fit"]
    coef = {"prefill": {"intercept_ms": m.prefill_intercept_ms, **dict(zip(("n", "n*c"), m.prefill_coef))},
            "decode": {"intercept_ms": m.decode_intercept_ms, **dict(zip(("B", "K"), m.decode_coef))},
            "mixed": dict(zip(("p", "p^2", "p*c", "p*K"), m.mixed_delta_coef))}
    return [{"row": "fit", "kind": k, "samples": fit["samples"][k],
             "heldout": sum(v["rows"] for v in fit["mape_regions"][k].values()),
             "mape_heldout": round(m.mape[k], 2), "outliers_rejected": fit["rejected"]["outlier"],
             "coef": {f: float(f"{v:.6g}") for f, v in coef[k].items()}} for k in ("prefill", "decode", "mixed")]


def measure(args: argparse.Namespace, t_start: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Build the model, check it against transformers, time the grid within the budget: (config row, step rows)."""
    import torch

    threads = torch.get_num_threads()
    if args.device == "cpu":  # a shared CPU's OpenMP spin-waits make tiny multi-threaded steps ~50x slower
        torch.set_num_threads(1)
    try:
        return _measure(args, t_start)
    finally:
        torch.set_num_threads(threads)


def _measure(args: argparse.Namespace, t_start: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import torch
    import transformers

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("gpu_step_times: --device cuda but torch sees no CUDA device")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    # The formulation (positions, masks, GQA grouping) strictly on the smoke model in float32 on this device,
    # then the measured model in its dtype (a loose bound: 16-bit rounding over many layers).
    errs = {}
    for name, tol in (("smoke", 1e-4), (args.arch, 1e-4 if dtype == torch.float32 else 5e-2)):
        model = build_model(name, args.device, torch.float32 if name == "smoke" else dtype)
        errs[name] = check_against_transformers(model)
        if not errs[name] <= tol:
            sys.exit(f"gpu_step_times: the packed step of {name} differs from transformers' forward "
                     f"(relative error {errs[name]:.2e} > {tol})")
    per_tok = kv_bytes_per_token(model)
    grid = GRIDS["smoke" if args.smoke else "cuda"]
    points = grid.points(args.seed)
    over = [pt for pt in points if pt[0] * (pt[1] + 1) * per_tok > args.max_kv_gib * 2**30]
    points = [pt for pt in points if pt not in over]
    config = {"row": "config", "arch": args.arch, **ARCHS[args.arch], "dtype": args.dtype, "device": args.device,
              "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "kv_bytes_per_token": per_tok,
              "check_relative_error": {k: float(f"{v:.3g}") for k, v in errs.items()}, "warmup": args.warmup, "repeats": args.repeats,
              "points_planned": len(points), "points_over_kv_cap": len(over), "budget_s": args.budget_s}
    print(f"model {args.arch} {args.dtype} on {config['device_name']} built and checked in "
          f"{time.monotonic() - t_start:.0f} s; {len(points)} points", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    for i, pt in enumerate(points):
        if time.monotonic() - t_start > args.budget_s:
            print(f"budget of {args.budget_s} s spent after {i} of {len(points)} points", file=sys.stderr)
            break
        rows.append(time_point(model, pt, args.warmup, args.repeats))
        if i % 20 == 0 or i == len(points) - 1:
            print(f"[{time.monotonic() - t_start:5.0f} s] {i + 1}/{len(points)} B={pt[0]} ctx={pt[1]} p={pt[2]} "
                  f"c={pt[3]}: {rows[-1]['latency_ms']:.2f} ms", file=sys.stderr)
    config["points_measured"] = len(rows)
    return config, rows


def main(argv: list[str] | None = None) -> int:
    """CLI (see the module docstring). Exit 2 on bad arguments; the fit's ValueError is reported and exits 1."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="torch device: cuda, cuda:1, cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model and grid (seconds on CPU)")
    ap.add_argument("--arch", choices=sorted(ARCHS), help="model config (default llama-3-8b; smoke with --smoke)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                    help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--warmup", type=int, default=2, help="discarded steps per grid point")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per grid point (median recorded)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new points after this many s")
    ap.add_argument("--max-kv-gib", type=float, default=72.0, help="skip points whose decode KV (GiB) exceeds this")
    ap.add_argument("--seed", type=int, default=0, help="grid order and held-out split")
    ap.add_argument("--out", type=Path, help=f"result file (default {DEFAULT_OUT.relative_to(ROOT)}; none with --smoke)")
    ap.add_argument("--refit", type=Path, metavar="FILE", help="refit the step rows of a result file, rewrite it")
    args = ap.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or args.budget_s <= 0:
        ap.error("--warmup must be >= 0, --repeats >= 1, --budget-s > 0")
    t_start, started, load0 = time.monotonic(), _dt.datetime.now(_dt.timezone.utc), os.getloadavg()[0]
    command = ["python", *sys.argv] if argv is None else ["python", "bench/gpu_step_times.py", *argv]
    if args.refit:
        if not args.refit.is_file():
            ap.error(f"--refit: no file {args.refit}")
        res = load_result(args.refit.stem, args.refit.parent)
        keep = [r for r in res.rows if r.get("row") != "fit"]
        fits = fit_rows([r for r in keep if r.get("row") == "step"], args.seed)
        write_result(args.refit, {**res.meta, "refit_command": " ".join(command)}, keep + fits)
        _print(fits)
        return 0
    args.arch = args.arch or ("smoke" if args.smoke else "llama-3-8b")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        ap.error(f"measuring needs {' and '.join(missing)} installed (--refit needs neither)")
    if not (can_fit := importlib.util.find_spec("sklearn") is not None):
        print("gpu_step_times: no scikit-learn: recording steps only (fit later: --refit FILE)", file=sys.stderr)
    config, steps = measure(args, t_start)
    fits = fit_rows(steps, args.seed) if can_fit else []
    out = args.out or (None if args.smoke else DEFAULT_OUT)
    if out:
        meta = result_meta(command, started, load0, time.monotonic() - t_start)
        print(f"wrote {write_result(out, meta, [config, *steps, *fits])}", file=sys.stderr)
    _print([config, *fits])
    return 0


def _print(rows: list[dict[str, Any]]) -> None:
    print("".join(json.dumps(r) + "\n" for r in rows), end="", flush=True)
    for r in rows:
        if r.get("row") == "fit":
            print(f"{r['kind']:8s} held-out MAPE {r['mape_heldout']:6.2f} %  ({r['heldout']} of {r['samples']} rows)",
                  file=sys.stderr)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as exc:
        sys.exit(f"gpu_step_times: {exc}")
