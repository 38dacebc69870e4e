"""Run the quality tasks over a list of caches and collect one JSON-serializable result."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field

import torch

from . import tasks
from .caches import CacheSpec, backend_status, cache_bytes, measure_bytes_synthetic

TASKS = ("ppl", "needle", "agreement", "bytes")


@dataclass
class EvalSettings:
    ppl_tokens: int = 4096
    chunk: int = 256
    needle_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 7680])
    needle_depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    needle_new_tokens: int = 8
    agreement_prompts: int = 4
    agreement_prompt_tokens: int = 512
    agreement_new_tokens: int = 256
    bytes_tokens: int = 4096
    text_start: int | None = None  # paragraph index into tq_hf_cache.tools.texts; None: texts.HELD_OUT_START
    seed: int = 0


def eval_texts(tokenizer, s: EvalSettings):
    """(token stream (1, n) for perplexity + agreement prompts, paragraphs for needle haystacks, source)."""
    from .. import texts

    start = texts.HELD_OUT_START if s.text_start is None else s.text_start
    need = s.ppl_tokens + s.agreement_prompts * s.agreement_prompt_tokens
    chars = max(4000, need * 6)
    while True:
        text = texts.package_text(chars, start=start)
        ids = tokenizer(text, return_tensors="pt").input_ids
        if ids.shape[1] >= need + 1:
            break
        chars *= 2  # raises ValueError once the package text runs out
    paras = list(texts.paragraphs()[start:])
    return ids, paras, {"source": texts.TEXT_SOURCE, "start_paragraph": start}


def _log(log, msg):
    if log is not None:
        log(msg)


def run_eval(model, tokenizer, model_info: dict, specs: list[CacheSpec], tasks_to_run=TASKS,
             settings: EvalSettings | None = None, out_json: str | None = None, log=print) -> dict:
    """Evaluate every cache in `specs` ("fp" is always run first: it is the reference)."""
    s = settings or EvalSettings()
    unknown = set(tasks_to_run) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks {sorted(unknown)}; tasks are {TASKS}")
    if not any(sp.family == "fp" for sp in specs):
        specs = [CacheSpec("fp", "fp"), *specs]
    specs = sorted(specs, key=lambda sp: sp.family != "fp")
    cfg = model.config
    ids, paras, text_info = eval_texts(tokenizer, s)
    ppl_ids = ids[:, : s.ppl_tokens]
    prompts = [ids[:, s.ppl_tokens + i * s.agreement_prompt_tokens: s.ppl_tokens + (i + 1) * s.agreement_prompt_tokens]
               for i in range(s.agreement_prompts)]
    max_pos = model_info.get("max_position_embeddings") or 10**9
    lengths = [L for L in s.needle_lengths if L + s.needle_new_tokens <= max_pos]
    needle_prompts = {}
    if "needle" in tasks_to_run:
        codes = tasks.needle_codes(lengths, s.needle_depths, s.seed)
        for (L, d), code in codes.items():
            needle_prompts[(L, d)] = tasks.build_needle_prompt(tokenizer, paras, L, d, code)

    result = {
        "model": model_info,
        "settings": asdict(s) | {"needle_lengths": lengths},
        "text": text_info,
        "tasks": list(tasks_to_run),
        "environment": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                        "python": platform.python_version(), "dtype": str(model.dtype).replace("torch.", ""),
                        "threads": torch.get_num_threads(), "device": "cpu"},
        "caches": {},
    }
    ref = {}
    t_start = time.time()
    for spec in specs:
        ok, reason = backend_status(spec.family)
        entry = {"spec": spec.to_dict(), "available": ok}
        result["caches"][spec.name] = entry
        if not ok:
            entry["reason"] = reason
            _log(log, f"[{spec.name}] not available: {reason}")
            _write(out_json, result)
            continue
        make = lambda spec=spec: spec.make(cfg)  # noqa: E731
        timings = entry["seconds"] = {}
        try:
            if "ppl" in tasks_to_run or "bytes" in tasks_to_run:
                t = time.time()
                ppl, argmax, cache = tasks.perplexity(model, ppl_ids, make, s.chunk, ref.get("argmax"))
                timings["ppl"] = round(time.time() - t, 1)
                if spec.family == "fp":
                    ref["argmax"], ref["ppl"] = argmax, ppl["ppl"]
                    ppl["top1_agreement"] = 1.0
                ppl["delta_pct"] = 100.0 * (ppl["ppl"] / ref["ppl"] - 1.0)
                if "ppl" in tasks_to_run:
                    entry["perplexity"] = ppl
                    _log(log, f"[{spec.name}] ppl {ppl['ppl']:.4f} ({ppl['delta_pct']:+.3f}% vs fp) "
                              f"top1 {ppl['top1_agreement']:.4f} in {timings['ppl']} s")
                if "bytes" in tasks_to_run:
                    entry["bytes"] = _bytes_entry(spec, cfg, model_info, cache, ppl_ids.shape[1], s.bytes_tokens,
                                                  result["environment"]["dtype"])
                del cache
            if "needle" in tasks_to_run:
                t = time.time()
                rows = tasks.needle(model, tokenizer, paras, make, lengths, s.needle_depths, s.chunk,
                                    s.needle_new_tokens, s.seed, prompts=needle_prompts)
                timings["needle"] = round(time.time() - t, 1)
                if spec.family == "fp":
                    ref["needle"] = rows
                for r, fr in zip(rows, ref["needle"]):
                    r["same_answer_as_fp"] = r["answer_ids"] == fr["answer_ids"]
                    r["same_found_as_fp"] = r["found"] == fr["found"]
                entry["needle"] = {
                    "found": sum(r["found"] for r in rows), "total": len(rows),
                    "same_found_as_fp": sum(r["same_found_as_fp"] for r in rows),
                    "same_answer_as_fp": sum(r["same_answer_as_fp"] for r in rows),
                    "prompts": rows,
                }
                _log(log, f"[{spec.name}] needle found {entry['needle']['found']}/{len(rows)}, "
                          f"same as fp {entry['needle']['same_found_as_fp']}/{len(rows)} in {timings['needle']} s")
            if "agreement" in tasks_to_run and s.agreement_prompts > 0:
                t = time.time()
                if spec.family == "fp":
                    ref["gen"] = [tasks.fp_generation(model, p, make, s.agreement_new_tokens, s.chunk) for p in prompts]
                rows = [tasks.agreement(model, p, make, g, s.chunk) for p, g in zip(prompts, ref["gen"])]
                timings["agreement"] = round(time.time() - t, 1)
                entry["agreement"] = {
                    "prefix_match": sum(r["prefix_match"] for r in rows) / len(rows),
                    "top1_agreement": sum(r["top1_agreement"] for r in rows) / len(rows),
                    "min_first_divergence": min(r["first_divergence"] for r in rows),
                    "prompts": rows,
                }
                _log(log, f"[{spec.name}] agreement prefix {entry['agreement']['prefix_match']:.3f} "
                          f"top1 {entry['agreement']['top1_agreement']:.3f} in {timings['agreement']} s")
        except Exception as e:  # record, keep going with the other caches
            import traceback

            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-2000:]
            _log(log, f"[{spec.name}] FAILED: {entry['error']}")
        _write(out_json, result)
    result["seconds_total"] = round(time.time() - t_start, 1)
    _write(out_json, result)
    return result


def _bytes_entry(spec, cfg, info, cache, tokens, synthetic_tokens, dtype_name) -> dict:
    measured = cache_bytes(cache)
    n_layers, h, d = info["num_layers"], info["num_key_value_heads"], info["head_dim"]
    per_layer_formula = spec.formula_bytes_per_token_layer(h, d, dtype_bytes=2)
    out = {
        "formula_fp16_per_token_per_layer": per_layer_formula,
        "formula_fp16_per_token": per_layer_formula * n_layers,
        "formula_bits_per_coordinate": per_layer_formula * 8 / (2 * h * d),
        "measured_eval_dtype": {
            "dtype": dtype_name,
            "tokens": tokens, "total": measured["total"], "workspace": measured["workspace"],
            "per_token": measured["total"] / tokens,
            "per_token_per_layer": [b / tokens for b in measured["per_layer"]],
        },
    }
    if synthetic_tokens:
        syn = measure_bytes_synthetic(spec, cfg, synthetic_tokens, torch.float16)
        out["measured_fp16"] = {
            "tokens": synthetic_tokens, "total": syn["total"], "workspace": syn["workspace"],
            "per_token": syn["total"] / synthetic_tokens,
            "per_token_per_layer": [b / synthetic_tokens for b in syn["per_layer"]],
        }
    return out


def _write(path, result):
    if not path:
        return
    from ..._io import write_text

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text(path, json.dumps(result, indent=1, default=str))
