"""Diagnostics behind docs/eval_findings.md: which knob moves the k4v4 / k3v3 perplexity gap on SmolLM2.

Variants (chunked-prefill perplexity, same text and chunking as `tq-hf-cache eval`):
- the presets as shipped (float16 norms, residual 128, randomized Hadamard rotation for power-of-two head dims);
- norm_dtype float32; residual_length 0 and 256; rotation "orthogonal" (a dense random orthogonal matrix);
- "norm-corrected": the stored norm is ||x|| / ||c[idx]|| so that the dequantized vector keeps the original
  length. The library stores ||x|| and dequantizes ||x|| * Pi^T c[idx], whose length is ||x|| * ||c[idx]|| < ||x||
  on average (an MSE quantizer shrinks): every key is shortened, which flattens the attention softmax. This
  variant is applied here by wrapping `tq_hf_cache.reference.quantize` for the duration of one run; the library
  files are not modified.

    python benchmarks/studies/eval_diagnostics.py --tokens 2048 --output benchmarks/results/eval_diagnostics_smollm2.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch

from tq_hf_cache import reference
from tq_hf_cache.eval import tasks
from tq_hf_cache.eval.caches import turboquant_spec
from tq_hf_cache.eval.models import load_model
from tq_hf_cache.eval.runner import EvalSettings, eval_texts


@contextlib.contextmanager
def norm_corrected():
    orig = reference.quantize

    def quantize(x, rotation, codebook, norm_dtype=torch.float16):
        packed, norms = orig(x, rotation, codebook, torch.float32)
        idx = reference.unpack_indices(packed, codebook.bits, rotation.dim)
        qnorm = reference.centroid_lookup(idx, codebook).norm(dim=-1).clamp_min(1e-12)
        return packed, reference.store_norm(norms / qnorm, norm_dtype)

    reference.quantize = quantize
    try:
        yield
    finally:
        reference.quantize = orig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--presets", default="k4v4,k3v3")
    ap.add_argument("--variants", default="preset,norm-corrected,norm32,r0,r256,orthogonal",
                    help="comma-separated subset of preset,norm-corrected,norm32,r0,r256,orthogonal,orthogonal-norm-corrected,"
                         "calibrated (tq_hf_cache.calibration codebooks fitted on --calib-tokens tokens of the package "
                         "text from paragraph 0, disjoint from the evaluated held-out slice)")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, info = load_model(args.model)
    ids, _, text_info = eval_texts(tok, EvalSettings(ppl_tokens=args.tokens, agreement_prompts=0))
    ids = ids[:, : args.tokens]
    cfg = model.config
    out = {"model": info, "tokens": args.tokens, "chunk": args.chunk, "text": text_info, "variants": {}}

    def run(name, make, ctx=contextlib.nullcontext(), ref=None):
        t = time.time()
        with ctx:
            res, argmax, _ = tasks.perplexity(model, ids, make, args.chunk, ref)
        res["seconds"] = round(time.time() - t, 1)
        out["variants"][name] = res
        base = out["variants"].get("fp", res)["ppl"]
        res["delta_pct"] = 100 * (res["ppl"] / base - 1)
        print(f"{name:28s} ppl {res['ppl']:.4f} ({res['delta_pct']:+.3f}%) top1 {res.get('top1_agreement', 1):.4f}",
              flush=True)
        if args.output:
            with open(args.output, "w") as f:
                json.dump(out, f, indent=1)
        return argmax

    from transformers import DynamicCache

    ref = run("fp", lambda: DynamicCache(config=cfg))
    variants = {
        "preset": ("", {}, False),
        "norm-corrected": (" norm-corrected", {}, True),
        "norm32": (" norm_dtype=float32", {"norm_dtype": "float32"}, False),
        "r0": (" residual_length=0", {"residual_length": 0}, False),
        "r256": (" residual_length=256", {"residual_length": 256}, False),
        "orthogonal": (" rotation=orthogonal", {"rotation": "orthogonal"}, False),
        "orthogonal-norm-corrected": (" rotation=orthogonal norm-corrected", {"rotation": "orthogonal"}, True),
    }
    for p in args.presets.split(","):
        for v in args.variants.split(","):
            if v == "calibrated":
                from tq_hf_cache import TurboQuantCache, TurboQuantConfig
                from tq_hf_cache.calibration import calibrate
                from tq_hf_cache.texts import package_text

                tq_cfg = TurboQuantConfig.from_preset(p)
                cb = calibrate(model, package_text(args.calib_tokens * 6, start=0), tq_cfg, tokenizer=tok,
                               max_tokens=args.calib_tokens, progress=False)
                run(p + " calibrated", lambda tq_cfg=tq_cfg, cb=cb: TurboQuantCache(tq_cfg, config=cfg, codebooks=cb),
                    ref=ref)
                continue
            suffix, kw, corrected = variants[v]
            run(p + suffix, lambda p=p, kw=kw: turboquant_spec(p, **kw).make(cfg),
                norm_corrected() if corrected else contextlib.nullcontext(), ref=ref)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
