"""Old module paths of the package (before its sub-packages, and `kernels.fast`, now `kernels.cuda`) as aliases of the
new ones: `import tq_hf_cache.layer` gives the module `tq_hf_cache.hf.layer` itself, so code, pickles and monkeypatches
that name an old path keep working. A moved package's modules follow it (`tq_hf_cache.kernels.fast.jit` is
`tq_hf_cache.kernels.cuda.jit`). Installed once by `tq_hf_cache/__init__.py`; it holds names only."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "tq_hf_cache.allocation": "tq_hf_cache.calibrate.allocation",
    "tq_hf_cache.attention": "tq_hf_cache.hf.attention",
    "tq_hf_cache.bench": "tq_hf_cache.tools.bench",
    "tq_hf_cache.cache": "tq_hf_cache.hf.cache",
    "tq_hf_cache.calibration": "tq_hf_cache.calibrate.calibration",
    "tq_hf_cache.cli": "tq_hf_cache.tools.cli",
    "tq_hf_cache.codebook": "tq_hf_cache.quant.codebook",
    "tq_hf_cache.codebooks_file": "tq_hf_cache.calibrate.codebooks_file",
    "tq_hf_cache.crop": "tq_hf_cache.hf.crop",
    "tq_hf_cache.derived": "tq_hf_cache.quant.derived",
    "tq_hf_cache.distributed": "tq_hf_cache.hf.distributed",
    "tq_hf_cache.eval": "tq_hf_cache.tools.eval",
    "tq_hf_cache.hybrid_layer": "tq_hf_cache.hf.hybrid_layer",
    "tq_hf_cache.kernels.fast": "tq_hf_cache.kernels.cuda",
    "tq_hf_cache.key_split": "tq_hf_cache.quant.key_split",
    "tq_hf_cache.layer": "tq_hf_cache.hf.layer",
    "tq_hf_cache.models": "tq_hf_cache.tools.models",
    "tq_hf_cache.norm_check": "tq_hf_cache.quant.norm_check",
    "tq_hf_cache.ops": "tq_hf_cache.kernels.ops",
    "tq_hf_cache.packed_kv": "tq_hf_cache.quant.packed_kv",
    "tq_hf_cache.packing": "tq_hf_cache.quant.packing",
    "tq_hf_cache.prefix_catalog": "tq_hf_cache.prefix.catalog",
    "tq_hf_cache.prefix_checks": "tq_hf_cache.prefix.checks",
    "tq_hf_cache.prefix_disk": "tq_hf_cache.prefix.disk",
    "tq_hf_cache.prefix_index": "tq_hf_cache.prefix.index",
    "tq_hf_cache.prefix_pages": "tq_hf_cache.prefix.pages",
    "tq_hf_cache.prefix_store": "tq_hf_cache.prefix.store",
    "tq_hf_cache.reference": "tq_hf_cache.quant.reference",
    "tq_hf_cache.rope": "tq_hf_cache.quant.rope",
    "tq_hf_cache.rotation": "tq_hf_cache.quant.rotation",
    "tq_hf_cache.sliding_layer": "tq_hf_cache.hf.sliding_layer",
    "tq_hf_cache.static_cache": "tq_hf_cache.hf.static_cache",
    "tq_hf_cache.texts": "tq_hf_cache.tools.texts",
    "tq_hf_cache.workspace": "tq_hf_cache.hf.workspace",
}


def new_name(name: str) -> str | None:
    """The new path of an old module path (a module under a moved package too), else None."""
    head, rest = name, ""
    while head:
        if head in MOVED:
            return MOVED[head] + rest
        head, _, last = head.rpartition(".")
        rest = "." + last + rest
    return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module of its new path (one object under both names)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if new_name(name) else None

    def create_module(self, spec):
        module = importlib.import_module(new_name(spec.name))
        spec.loader_state = module.__spec__  # the import system sets the alias spec on it next: put back below
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias())  # before the path finder: an old folder left on disk must not win
