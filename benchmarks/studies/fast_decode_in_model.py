"""The fast decode kernel inside a model, against cuDNN SDPA inside the same model: a random bf16 model of a shape
(`--shape`, built on the GPU, torch seed 0) or of a checkpoint folder (`--model`), eager decode steps, each kernel's
device time from the profiler.
- `tq_decode`: each layer's launch as the model makes it ("in_model": the layer's other kernels have taken the
  kernel's code out of the SMs' instruction caches and out of L2), and the same launch made again at once ("again":
  code warm), `TurboQuantStaticCache` with `--preset`;
- SDPA: `StaticCache`'s attention kernels a layer (cuDNN's attention and reduction, or whichever SDPA backend serves
  the head dim), their medians summed, on the full-attention layers only (Gemma's sliding-window layers are
  transformers' own in both caches).
Usage:
    python benchmarks/studies/fast_decode_in_model.py (--shape smollm2-1.7b | --model DIR)
        [--cases 1x4096,1x16384,1x32768,2x4096] [--preset k5v3] [--steps 3] [--sources A.cu,B.cu --reps 3] --out F
`--sources`: other builds of the kernel's source (decode_mma.cu), timed in turns with the shipped one on the same
cache, `--reps` rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tq_hf_cache import bench  # noqa: E402
from tq_hf_cache._compat import layer_types_and_kwargs  # noqa: E402
from tq_hf_cache.kernels import cuda  # noqa: E402


def ours(model, batch: int, context: int, preset: str, steps: int, sources: dict[str, str], reps: int) -> dict:
    """tq_decode's us a call for each kernel source (name -> text), in turns over `reps` rounds on one prefilled
    cache: each launch in the model, and made again at once (medians of a round's calls, then of the rounds); and
    the plan it ran."""
    capacity = context + (steps + 1) * reps * len(sources) + 16
    prep = bench._Prepared(model, "tq_static_compiled", batch, context, capacity, 0, 8192, preset, None)
    prep.fwd = model.forward  # eager: each layer's launch goes through `cuda.decode`
    launch, shipped, plan = cuda.decode, cuda.source(), {}
    signature = inspect.signature(launch)

    def twice(*args, **kw):
        a = signature.bind(*args, **kw)
        a.apply_defaults()
        a = a.arguments
        plan.update(warps=a["w"], splits=a["num_splits"], fold=a["fold"], parts=a["parts"])
        ok = launch(*args, **kw)
        launch(*args, **kw)
        return ok

    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in sources}
    cuda.decode = twice
    try:
        for _ in range(reps):
            for name, text in sources.items():
                cuda._SOURCE = text
                prep.step()  # warm (and the variant built)
                us = [e.time_range.elapsed_us() for e in bench.kernel_events(prep.step, steps) if e.name == cuda.NAME]
                runs[name].append((statistics.median(us[0::2]), statistics.median(us[1::2])))
    finally:
        cuda.decode, cuda._SOURCE = launch, shipped
    return {name: dict(plan=dict(plan), in_model_us=round(statistics.median(r[0] for r in rs), 2),
                       again_us=round(statistics.median(r[1] for r in rs), 2),
                       rounds=[[round(x, 2) for x in r] for r in rs]) for name, rs in runs.items()}


def _attention_kernel(name: str) -> bool:
    """Whether a kernel is one of SDPA's (cuDNN's attention and reduction, flash, memory-efficient)."""
    return name != cuda.NAME and any(k in name for k in ("sdpa", "lean_reduction", "fmha", "flash", "attention"))


def sdpa(model, batch: int, context: int, steps: int) -> dict:
    """StaticCache's SDPA kernels (cuDNN's attention and reduction, or another backend's) on the layers our kernel
    serves (full attention; sliding-window layers are transformers' in both caches): us a call, their sum. A marker
    kernel (torch's spin kernel, 1 cycle) starts each layer's attention so that kernels are told by layer."""
    full = [t == "full_attention" for t in layer_types_and_kwargs(model.config)[0]]
    prep = bench._Prepared(model, "static_compiled", batch, context, context + 8 * steps + 16, 0, 8192, "k5v3", None)
    prep.fwd = model.forward
    marker = {e.name for e in bench.kernel_events(lambda: torch.cuda._sleep(1), 1)}.pop()
    hooks = [layer.self_attn.register_forward_pre_hook(lambda *_: torch.cuda._sleep(1)) for layer in model.model.layers]
    try:
        prep.step()
        events = bench.kernel_events(prep.step, steps)
    finally:
        for h in hooks:
            h.remove()
    per: dict[str, list[float]] = {}
    layer = -1
    for e in events:
        if e.name == marker:
            layer += 1
        elif layer >= 0 and full[layer % len(full)] and _attention_kernel(e.name):
            per.setdefault(e.name, []).append(e.time_range.elapsed_us())
    if layer + 1 != steps * len(full):
        raise RuntimeError(f"{layer + 1} layer markers in {steps} steps of {len(full)} layers")
    kernels = {k: round(statistics.median(v), 2) for k, v in per.items()}
    return dict(kernels=kernels, us=round(sum(kernels.values()), 2), layers=sum(full))


def shape_config(shape: str):
    """The transformers config of a `--shape`: the decoder of the named model, its sizes only."""
    import transformers

    if shape == "llama-3.1-8b":
        return bench.llama_8b_config()
    if shape == "smollm2-1.7b":
        return transformers.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192,
                                        num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                                        head_dim=64, max_position_embeddings=140000, rope_theta=130000.0,
                                        tie_word_embeddings=True)
    if shape == "gemma-3-4b":
        return transformers.Gemma3TextConfig(vocab_size=262208, hidden_size=2560, intermediate_size=10240,
                                             num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                                             head_dim=256, sliding_window=1024, max_position_embeddings=140000)
    raise ValueError(f"--shape {shape!r}: choose from {SHAPES}")


SHAPES = ("smollm2-1.7b", "llama-3.1-8b", "gemma-3-4b")


def load(shape: str | None, folder: str | None):
    """The model in bf16 on the GPU, eval mode: random of `shape`, or read from `folder`."""
    import transformers

    if folder is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    torch.manual_seed(0)
    with torch.device("cuda"):
        return transformers.AutoModelForCausalLM.from_config(shape_config(shape)).to(torch.bfloat16).eval()


def main():
    ap = argparse.ArgumentParser()
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--shape", choices=SHAPES)
    src.add_argument("--model", help="a checkpoint folder")
    ap.add_argument("--cases", default="1x4096,1x16384,1x32768,2x4096")
    ap.add_argument("--preset", default="k5v3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--sources", default="", help="kernel source files to time in turns with the shipped one")
    ap.add_argument("--reps", type=int, default=1, help="rounds of the sources, interleaved")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    sources = {"shipped": cuda.source()}
    for path in filter(None, a.sources.split(",")):
        with open(path) as fh:
            sources[path] = fh.read()
    model = load(a.shape, a.model)
    rows = {}
    for case in a.cases.split(","):
        b, t = map(int, case.split("x"))
        row = dict(tq=ours(model, b, t, a.preset, a.steps, sources, a.reps), sdpa=sdpa(model, b, t, a.steps))
        sd = row["sdpa"]["us"]
        row["sdpa_over_tq_in_model"] = {name: round(sd / r["in_model_us"], 2) if sd else None
                                        for name, r in row["tq"].items()}
        rows[case] = row
        print(case, row, flush=True)
        torch.cuda.empty_cache()
    with open(a.out, "w") as fh:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, model=a.model or a.shape,
                       layers=model.config.num_hidden_layers, preset=a.preset, when=time.strftime("%Y-%m-%d %H:%M"),
                       sources={name: hashlib.sha1(text.encode()).hexdigest()[:8] for name, text in sources.items()},
                       command=" ".join(sys.argv), rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
