"""The docs' snippets run as written: every ```python block of docs/usage.md, in order, in one namespace."""

import os
import re

import pytest

DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs")


def python_blocks(name):
    with open(os.path.join(DOCS, name), encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.model
def test_usage_snippets_run(smollm2, monkeypatch):
    import tq_hf_cache.models
    from tq_hf_cache._compat import IS_V5

    model = smollm2[0]
    monkeypatch.setattr(tq_hf_cache.models, "load_smollm2", lambda *a, **k: smollm2)
    blocks = python_blocks("usage.md")
    assert len(blocks) >= 10
    namespace = {}
    try:
        for i, code in enumerate(blocks):
            if "TurboQuantStaticCache" in code and not IS_V5:
                continue
            exec(compile(code, f"docs/usage.md block {i}", "exec"), namespace)
    finally:
        model.set_attn_implementation("sdpa")
    assert namespace["out"].shape[1] > namespace["prompt_ids"].shape[1]
