"""Held-out K/V reconstruction error of SmolLM2-135M: theoretical vs calibrated codebooks, per bit width.

    python scripts/calibration_figures.py [--calib-tokens 4096] [--heldout-tokens 2048]

Calibrates on the first paragraphs of tq_hf_cache.tools.texts.package_text (stdlib pydoc topics) and measures on
paragraphs from texts.HELD_OUT_START on (disjoint text). Prints a Markdown table of mean relative MSE
||x - x_hat||^2 / ||x||^2 over all layers, heads and tokens.
"""

import argparse
import time

import torch

from tq_hf_cache import TurboQuantConfig
from tq_hf_cache.calibrate.calibration import calibrate, measure_reconstruction
from tq_hf_cache.tools.models import load_smollm2
from tq_hf_cache.tools.texts import HELD_OUT_START, package_text

p = argparse.ArgumentParser()
p.add_argument("--calib-tokens", type=int, default=4096)
p.add_argument("--heldout-tokens", type=int, default=2048)
p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4])
a = p.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)  # the shared CPU: keep to one core
model, tok = load_smollm2()
cfg = TurboQuantConfig(key_bits=4, value_bits=4)
t0 = time.time()
cb = calibrate(model, package_text(8 * a.calib_tokens), cfg, tokenizer=tok, extra_bits=a.bits, max_tokens=a.calib_tokens)
t1 = time.time()
held = package_text(8 * a.heldout_tokens, start=HELD_OUT_START)
theo = measure_reconstruction(model, held, cfg, None, bits=a.bits, tokenizer=tok, max_tokens=a.heldout_tokens)
cal = measure_reconstruction(model, held, cfg, cb, bits=a.bits, tokenizer=tok, max_tokens=a.heldout_tokens)
print(f"calibration: {cb.info['num_tokens']} tokens in {t1 - t0:.1f} s; held-out: {a.heldout_tokens} tokens")
summary = cb.summary()
print("| kind | bits | theoretical | calibrated | change | layers theoretical/shared/per-head |")
print("|---|---|---|---|---|---|")
for k in theo:
    kind, b = k.split("_")
    ch = summary[k]["choices"]
    print(f"| {kind} | {b[:-3]} | {theo[k]:.6f} | {cal[k]:.6f} | {100 * (cal[k] / theo[k] - 1):+.2f} % | "
          f"{ch['theoretical']}/{ch['shared']}/{ch['per_head']} |")
