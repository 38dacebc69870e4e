"""Calibrate codebooks for a model, save them beside it, reload them, and compare with the theoretical codebooks.

    python examples/calibrate_and_save.py                       # embedded SmolLM2-135M-Instruct, CPU
    python examples/calibrate_and_save.py --out my_model_dir --preset k4v2 --tokens 4096

1. `calibrate` runs the model over package-shipped text and fits per-layer (and, where it pays on held-out
   tokens, per-KV-head) Lloyd-Max codebooks to the real rotated K/V coordinates.
2. `save_pretrained(dir)` writes `turboquant_config.json` and `turboquant_codebooks.safetensors`, next to a model
   checkpoint if `dir` holds one (`tq-hf-cache calibrate MODEL_DIR` does steps 1-2 from the command line).
3. `TurboQuantCache.from_pretrained(dir, config=model.config)` reloads them; the model facts are checked.
4. Reconstruction error of the model's K/V and perplexity on text the calibration never saw, both codebooks.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from tq_hf_cache import PRESETS, TurboQuantCache, TurboQuantConfig  # noqa: E402
from tq_hf_cache.calibrate.calibration import calibrate, measure_reconstruction  # noqa: E402
from tq_hf_cache.tools.eval.tasks import perplexity  # noqa: E402
from tq_hf_cache.tools.texts import HELD_OUT_START, package_text  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="k4v2", choices=sorted(PRESETS),
                   help="bits to calibrate (default k4v2: at 3 bits per coordinate calibration matters most)")
    p.add_argument("--tokens", type=int, default=2048, help="calibration tokens (default %(default)s)")
    p.add_argument("--eval-tokens", type=int, default=1024, help="held-out tokens for perplexity (default %(default)s)")
    p.add_argument("--out", default=None,
                   help="folder to save into and keep (default: a temporary folder, removed at the end)")
    args = p.parse_args(argv)

    from tq_hf_cache.tools.models import load_smollm2

    model, tok = load_smollm2()
    if args.out:
        return run(args, model, tok, args.out)
    with tempfile.TemporaryDirectory(prefix="tq_calibrated_") as out:
        code = run(args, model, tok, out)
    print(f"removed {out} (pass --out DIR to keep the files)")
    return code


def run(args, model, tok, out: str) -> int:
    config = TurboQuantConfig.from_preset(args.preset)

    print(f"1. calibrating {args.preset} on {args.tokens} tokens of package text")
    text = package_text(min_chars=6 * args.tokens)  # from the start of the prose; the evaluation text comes later
    codebooks = calibrate(model, text, config, tokenizer=tok, max_tokens=args.tokens, progress=False)
    for name, row in codebooks.summary().items():
        ch = row["choices"]
        print(f"   {name}: held-out relative MSE {row['theoretical']:.5f} (theoretical) -> {row['chosen']:.5f}; "
              f"layers choosing theoretical/shared/per-head {ch['theoretical']}/{ch['shared']}/{ch['per_head']}")

    print(f"2. saving into {out}")
    codebooks.save_pretrained(out)
    print("   " + ", ".join(sorted(os.listdir(out))))

    print("3. reloading with TurboQuantCache.from_pretrained")
    calibrated = lambda: TurboQuantCache.from_pretrained(out, config=model.config)  # noqa: E731
    theoretical = lambda: TurboQuantCache(config, config=model.config)  # noqa: E731
    assert calibrated().codebooks is not None

    print("4. the same model on text the calibration never saw")
    held_out = package_text(6 * args.eval_tokens, start=HELD_OUT_START)
    rec = {
        "theoretical": measure_reconstruction(model, held_out, config, None, tokenizer=tok, max_tokens=args.eval_tokens),
        "calibrated": measure_reconstruction(model, held_out, config, calibrated().codebooks, tokenizer=tok,
                                             max_tokens=args.eval_tokens),
    }
    for kind in rec["theoretical"]:
        t, c = rec["theoretical"][kind], rec["calibrated"][kind]
        print(f"   {kind} relative MSE of the model's real vectors: theoretical {t:.5f}, calibrated {c:.5f} "
              f"({100 * (c / t - 1):+.1f}%)")
    ids = tok(held_out, return_tensors="pt").input_ids[:, : args.eval_tokens]
    with torch.no_grad():
        fp = perplexity(model, ids, lambda: TurboQuantCache(config, config=model.config, residual_length=10**6))[0]
        ppl = {name: perplexity(model, ids, make)[0] for name, make in (("theoretical", theoretical),
                                                                       ("calibrated", calibrated))}
    print(f"   perplexity over {ids.shape[1]} tokens (chunked prefill, 256-token chunks): full precision "
          f"{fp['ppl']:.3f}")
    for name, r in ppl.items():
        print(f"     {name:<12} {r['ppl']:.3f} ({100 * (r['ppl'] / fp['ppl'] - 1):+.2f}% against full precision)")
    if not all(math.isfinite(r["ppl"]) for r in ppl.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
