"""`tq-hf-cache eval`: the quality evaluation from the command line.

    tq-hf-cache eval                                  # SmolLM2 (embedded), every cache, every task
    tq-hf-cache eval --quick                          # a few hundred tokens: a smoke run in about a minute
    tq-hf-cache eval --model gemma3-270m --caches fp,k4v4,quanto-int4 --tasks ppl,bytes
    tq-hf-cache eval --model /path/to/hf_folder_or.gguf --output results.json

Also `python -m tq_hf_cache.eval ...` with the same options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _ints(s):
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s):
    return [float(x) for x in s.split(",") if x.strip()]


def _names(s):
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .caches import DEFAULT_CACHES, all_specs
    from .runner import TASKS, EvalSettings

    d = EvalSettings()
    parser.add_argument("--model", default="smollm2",
                        help="builtin 'smollm2' (default) or 'gemma3-270m', or a local HF model folder or .gguf file")
    parser.add_argument("--caches", type=_names, default=list(DEFAULT_CACHES),
                        help=f"comma-separated caches (default: {','.join(DEFAULT_CACHES)}); known: {','.join(all_specs())}")
    parser.add_argument("--tasks", type=_names, default=list(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    parser.add_argument("--ppl-tokens", type=int, default=d.ppl_tokens, help="tokens of package text scored (default %(default)s)")
    parser.add_argument("--chunk", type=int, default=d.chunk, help="chunked-prefill chunk size (default %(default)s)")
    parser.add_argument("--needle-lengths", type=_ints, default=d.needle_lengths, help="comma-separated prompt lengths in tokens")
    parser.add_argument("--needle-depths", type=_floats, default=d.needle_depths, help="comma-separated needle depths in [0, 1]")
    parser.add_argument("--agreement-prompts", type=int, default=d.agreement_prompts)
    parser.add_argument("--agreement-prompt-tokens", type=int, default=d.agreement_prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=d.agreement_new_tokens, help="greedy tokens compared with fp (default %(default)s)")
    parser.add_argument("--bytes-tokens", type=int, default=d.bytes_tokens,
                        help="tokens of synthetic float16 KV states for the deployment-dtype byte count (0: skip)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype (CPU: float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the needle codes")
    parser.add_argument("--quick", action="store_true",
                        help="small budget: 512 ppl tokens, needle 512 tokens at depth 0.5, 1 prompt x 32 tokens")
    parser.add_argument("--output", default=None, help="result JSON (default benchmarks/results/quality_<model>.json)")
    parser.add_argument("--markdown", default=None, help="also write/update the results table in this markdown file")
    parser.add_argument("--plot", default=None, help="also write the quality-vs-bytes plot (PNG) here")


def settings_from_args(args):
    from .runner import EvalSettings

    s = EvalSettings(
        ppl_tokens=args.ppl_tokens, chunk=args.chunk, needle_lengths=args.needle_lengths, needle_depths=args.needle_depths,
        agreement_prompts=args.agreement_prompts, agreement_prompt_tokens=args.agreement_prompt_tokens,
        agreement_new_tokens=args.new_tokens, bytes_tokens=args.bytes_tokens, seed=args.seed,
    )
    if args.quick:
        s.ppl_tokens, s.chunk, s.needle_lengths, s.needle_depths = 512, 128, [512], [0.5]
        s.agreement_prompts, s.agreement_prompt_tokens, s.agreement_new_tokens, s.bytes_tokens = 1, 256, 32, 512
    return s


def run(args) -> int:
    import torch

    from .caches import all_specs
    from .models import load_model
    from .runner import run_eval

    specs = all_specs()
    unknown = [c for c in args.caches if c not in specs]
    if unknown:
        print(f"unknown caches {unknown}; known: {', '.join(specs)}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    tag = os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]
    out = args.output or os.path.join("benchmarks", "results", f"quality_{tag}.json")
    t = time.time()
    model, tok, info = load_model(args.model, getattr(torch, args.dtype))
    print(f"loaded {info['label']} in {time.time() - t:.0f} s", flush=True)
    try:
        result = run_eval(model, tok, info, [specs[c] for c in args.caches], args.tasks, settings, out,
                          log=lambda m: print(m, flush=True))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["command"] = "tq-hf-cache eval " + " ".join(sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "eval" else sys.argv[1:])
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {out}")
    if args.markdown or args.plot:
        from .report import plot, update_markdown

        if args.markdown:
            update_markdown(args.markdown, [result])
            print(f"updated {args.markdown}")
        if args.plot:
            plot([result], args.plot)
            print(f"wrote {args.plot}")
    failed = [n for n, e in result["caches"].items() if "error" in e]
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tq-hf-cache eval", description="KV-cache quality evaluation on a real model")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
