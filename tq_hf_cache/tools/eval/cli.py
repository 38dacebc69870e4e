"""`tq-hf-cache eval`: the quality evaluation from the command line.

    tq-hf-cache eval                                  # SmolLM2 (embedded), every cache, every task
    tq-hf-cache eval --quick                          # a few hundred tokens: a smoke run in about a minute
    tq-hf-cache eval --model gemma3-270m --caches fp,k4v4,quanto-int4 --tasks ppl,bytes
    tq-hf-cache eval --model /path/to/hf_folder_or.gguf --output results.json

Also `python -m tq_hf_cache.tools.eval ...` with the same options.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _at_least(low: int):
    """argparse type: an integer >= low (argparse prints the bad value and exits 2 otherwise)."""

    def parse(s):
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {s!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v

    return parse


def _ints(s):
    vals = [_at_least(MIN_NEEDLE_TOKENS)(x) for x in s.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {MIN_NEEDLE_TOKENS}, got {s!r}")
    return vals


def _floats(s):
    vals = []
    for x in (x for x in s.split(",") if x.strip()):
        try:
            v = float(x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected numbers in [0, 1], got {x!r}") from None
        if not 0.0 <= v <= 1.0:
            raise argparse.ArgumentTypeError(f"needle depths are fractions of the prompt in [0, 1], got {v}")
        vals.append(v)
    if not vals:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers in [0, 1], got {s!r}")
    return vals


MIN_NEEDLE_TOKENS = 64  # the needle sentence and the question need room in the haystack


def _names(s):
    return [x.strip() for x in s.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .caches import DEFAULT_CACHES, all_specs
    from .runner import TASKS, EvalSettings

    d = EvalSettings()
    parser.add_argument("--model", default="smollm2",
                        help="builtin 'smollm2' (default) or 'gemma3-270m', or a local HF model folder or .gguf file")
    parser.add_argument("--caches", type=_names, default=list(DEFAULT_CACHES),
                        help=f"comma-separated caches (default: {','.join(DEFAULT_CACHES)}); known: {','.join(all_specs())}; "
                             "or a folder with a turboquant_config.json (e.g. from tq-hf-cache allocate)")
    parser.add_argument("--tasks", type=_names, default=list(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    parser.add_argument("--ppl-tokens", type=_at_least(2), default=d.ppl_tokens, help="tokens of package text scored (default %(default)s)")
    parser.add_argument("--chunk", type=_at_least(1), default=d.chunk, help="chunked-prefill chunk size (default %(default)s)")
    parser.add_argument("--needle-lengths", type=_ints, default=d.needle_lengths, help="comma-separated prompt lengths in tokens")
    parser.add_argument("--needle-depths", type=_floats, default=d.needle_depths, help="comma-separated needle depths in [0, 1]")
    parser.add_argument("--agreement-prompts", type=_at_least(0), default=d.agreement_prompts)
    parser.add_argument("--agreement-prompt-tokens", type=_at_least(1), default=d.agreement_prompt_tokens)
    parser.add_argument("--new-tokens", type=_at_least(1), default=d.agreement_new_tokens, help="greedy tokens compared with fp (default %(default)s)")
    parser.add_argument("--bytes-tokens", type=_at_least(0), default=d.bytes_tokens,
                        help="tokens of synthetic float16 KV states for the deployment-dtype byte count (0: skip)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype (CPU: float32)")
    parser.add_argument("--threads", type=_at_least(1), default=None, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the needle codes")
    parser.add_argument("--quick", action="store_true",
                        help="small budget: 512 ppl tokens, needle 512 tokens at depth 0.5, 1 prompt x 32 tokens")
    parser.add_argument("--output", default=None,
                        help="result JSON (default: a new tq_eval_<model>_<date-time>.json in the current folder; "
                             "the default never overwrites a file)")
    parser.add_argument("--markdown", default=None, help="also write/update the results table in this markdown file")
    parser.add_argument("--plot", default=None, help="also write the quality-vs-bytes plot (PNG) here")


def new_output_name(tag: str, folder: str = ".", prefix: str = "tq_eval") -> str:
    """A result file name that does not exist yet: <prefix>_<tag>_<date-time>[_n].json in `folder`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = os.path.join(folder, f"{prefix}_{tag}_{stamp}.json"), 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(folder, f"{prefix}_{tag}_{stamp}_{n}.json")
    return path


def output_problem(path: str, option: str, suffix: str | None = None, read: bool = False) -> str | None:
    """Why `path` cannot take an output file of `option` (None when it can), checked before any work: a folder, a
    non-regular or read-only file, a wrong suffix, a folder that cannot be written into (created if missing).
    `read`: the file is updated, so an existing one must be readable."""
    from ..._io import probe_writable

    full = os.path.abspath(path)
    if suffix and not full.lower().endswith(suffix):
        return f"{option} {path!r} must name a {suffix} file"
    if os.path.isdir(full):
        return f"{option} {path!r} is a folder; name a file (inside it, for instance)"
    if os.path.lexists(full) and not os.path.islink(full) and not os.path.isfile(full):
        return f"{option} {path!r} exists and is not a regular file"
    if os.path.isfile(full) and not os.access(full, os.W_OK | (os.R_OK if read else 0)):
        return f"{option} {path!r} exists and is not {'readable and ' if read else ''}writable"
    why = probe_writable(os.path.dirname(full))
    if why:
        return f"{option} {path!r}: cannot write into its folder: {why}"
    return None


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

    from ..._io import write_text
    from ...config import TURBOQUANT_CONFIG_NAME
    from .caches import folder_spec

    from .models import model_problem
    from .runner import TASKS

    bad = [t for t in args.tasks if t not in TASKS]
    if bad or not args.tasks:
        print(f"error: --tasks: {'unknown ' + ', '.join(map(repr, bad)) if bad else 'none given'}; allowed: "
              f"{', '.join(TASKS)} (comma-separated)", file=sys.stderr)
        return 2
    if not args.caches:
        print(f"error: --caches: none given; allowed: {', '.join(all_specs())}, or a folder with a "
              f"{TURBOQUANT_CONFIG_NAME}", file=sys.stderr)
        return 2
    problem = model_problem(args.model)
    if problem:
        print(f"error: --model: {problem}", file=sys.stderr)
        return 2
    specs = all_specs()
    for c in args.caches:  # a folder holding a turboquant_config.json (e.g. from `tq-hf-cache allocate`)
        if c not in specs and os.path.isfile(os.path.join(c, TURBOQUANT_CONFIG_NAME)):
            try:
                specs[c] = folder_spec(c)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
    unknown = [c for c in args.caches if c not in specs]
    if unknown:
        print(f"error: --caches: unknown {', '.join(map(repr, unknown))}; allowed: {', '.join(all_specs())}, or a "
              f"folder with a {TURBOQUANT_CONFIG_NAME}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    if "ppl" in args.tasks and settings.ppl_tokens <= settings.chunk:
        print(f"error: --ppl-tokens ({settings.ppl_tokens}) must exceed --chunk ({settings.chunk}): perplexity is "
              "scored on the chunks after the first, the ones that attend to the cache", file=sys.stderr)
        return 2
    tag = os.path.splitext(os.path.basename(os.path.normpath(args.model)))[0]
    out = args.output or new_output_name(tag)
    outputs = [(out, "--output", None, False), (args.markdown, "--markdown", None, True), (args.plot, "--plot", ".png", False)]
    for path, option, suffix, read in outputs:
        problem = path and output_problem(path, option, suffix, read)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    named = [os.path.abspath(p) for p, *_ in outputs if p]
    if len(set(named)) != len(named):
        print("error: --output, --markdown and --plot must name different files", file=sys.stderr)
        return 2
    t = time.time()
    try:
        model, tok, info = load_model(args.model, getattr(torch, args.dtype))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"loaded {info['label']} in {time.time() - t:.0f} s", flush=True)
    try:
        result = run_eval(model, tok, info, [specs[c] for c in args.caches], args.tasks, settings, out,
                          log=lambda m: print(m, flush=True))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["command"] = "tq-hf-cache eval " + " ".join(sys.argv[2:] if len(sys.argv) > 1 and sys.argv[1] == "eval" else sys.argv[1:])
    write_text(out, json.dumps(result, indent=1, default=str))
    from .report import text_summary

    print()
    print(text_summary(result))
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
