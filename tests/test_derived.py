"""Tensors derived from a quantizer (kernel tables, rotation operands, RoPE tables) are held by the object they derive
from (`tq_hf_cache.quant.derived`): no module of the package keeps them in a process-wide table, they go with the cache
that owns their objects, and no pickle or deep copy carries them."""

import collections
import copy
import gc
import pickle
import sys
import types
import weakref

import pytest
import torch

from conftest import static_logits, tiny_gemma3_config, tiny_llama_config, with_cache
from tq_hf_cache import Codebook, TurboQuantCache, make_rotation, theoretical_codebook
from tq_hf_cache._compat import IS_V5
from tq_hf_cache.quant.derived import Derived

CPU = torch.device("cpu")
# module globals that may hold tensors, and why they are no quantizer's tables
NOT_DERIVED = {"tq_hf_cache.kernels.decode_args._SCRATCH": "the eager decode scratch, per device and stream"}


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _use_every_table():
    """Build each kind of derived tensor on the CPU, through the functions the kernels and the reference call."""
    from tq_hf_cache import reference
    from tq_hf_cache.kernels import _common, cuda, quantize
    from tq_hf_cache.kernels.decode_attention import lookup_table
    from tq_hf_cache.quant.rope import RopeAngles

    had, orth = make_rotation(64, 5), make_rotation(48, 5, "orthogonal")
    cbs = [theoretical_codebook(b, 64) for b in (2, 4, 5)]
    cbs.append(Codebook.from_centroids(theoretical_codebook(5, 64).centroids * 1.5, 5))
    for cb in cbs:
        quantize.prepare(cb, 2, CPU)
        lookup_table(cb, 2, CPU)
        cuda.pair_table(cb, 2, CPU)
        reference._centroid_table(cb, CPU)
    for rot in (had, orth):
        _common.rotation_operand(rot, CPU, "fwd", torch.float32)
        _common.rotation_operand(rot, CPU, "inv", torch.float32)
        reference.row_major_matrix(rot, 3)
    cuda.prepare(had, cbs[0], cbs[1], 2, CPU)
    cuda.prepare(make_rotation(64, 5, "orthogonal"), cbs[0], cbs[1], 2, CPU)
    rope = RopeAngles(1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)), 1.0)
    rope.scores(torch.zeros(1, 64), torch.zeros(1, 64), 0, 300)
    assert all(len(cb.derived) for cb in cbs) and len(had.derived) and len(orth.derived) and len(rope.derived)
    return had, orth, cbs, rope


def _use_caches():
    import transformers

    from tq_hf_cache import TurboQuantStaticCache

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    llama.set_attn_implementation("turboquant")
    cache = TurboQuantCache(config=llama.config, residual_length=8)
    with torch.no_grad():
        llama(_ids(40), **with_cache(cache))
        llama(_ids(1, 2), **with_cache(cache))
    split = {0: {"sizes": [16, 16], "bits": [6, 3], "order": [list(range(31, -1, -1))] * 2}}
    static_logits(llama, TurboQuantStaticCache(config=llama.config, max_cache_len=64, residual_length=8,
                                               key_split=split), _ids(42), 40, "turboquant")
    cfg = tiny_gemma3_config(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])
    gemma = transformers.Gemma3ForCausalLM(cfg).eval()
    gemma.set_attn_implementation("turboquant")
    static_logits(gemma, TurboQuantStaticCache(config=gemma.config, max_cache_len=64, residual_length=8,
                                               key_centering=True), _ids(42), 40, "turboquant")


def _short(key) -> str:
    text = repr(key) if isinstance(key, (str, int, float, tuple, torch.device)) else type(key).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _held(value, path: str, depth: int, seen: set, found: list) -> None:
    """Append to `found` the path of every tensor or Derived that `value` holds (weak references not followed)."""
    if depth > 6 or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (torch.Tensor, Derived)):
        found.append(path)
    elif isinstance(value, weakref.WeakKeyDictionary):
        for k, v in list(value.items()):
            _held(v, f"{path}[{_short(k)}]", depth + 1, seen, found)
    elif isinstance(value, weakref.WeakValueDictionary):
        for k in list(value.keys()):
            _held(k, f"{path}[key {_short(k)}]", depth + 1, seen, found)
    elif isinstance(value, dict):
        for k, v in list(value.items()):
            _held(k, f"{path}[key {_short(k)}]", depth + 1, seen, found)
            _held(v, f"{path}[{_short(k)}]", depth + 1, seen, found)
    elif isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        for i, v in enumerate(list(value)):
            _held(v, f"{path}[{i}]", depth + 1, seen, found)
    elif (type(value).__module__ or "").startswith("tq_hf_cache") and hasattr(value, "__dict__") \
            and not isinstance(value, (type, types.FunctionType, types.ModuleType)):
        _held(vars(value), f"{path}.__dict__", depth + 1, seen, found)


@pytest.mark.skipif(not IS_V5, reason="TurboQuantStaticCache needs transformers >= 5")
def test_no_module_of_the_package_holds_tensors_derived_from_a_quantizer():
    """After caches (plain, split and centred keys) and every table builder have run, no module global of the
    package is or holds a tensor or a Derived (functools caches of functions of plain values aside: the theoretical
    codebooks' shared tables and the caches' rotations, made once per (bits, dim) and (dim, seed, kind))."""
    kept = _use_every_table()
    _use_caches()
    found = []
    for name, module in list(sys.modules.items()):
        if name != "tq_hf_cache" and not name.startswith("tq_hf_cache."):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, (type, types.FunctionType, types.ModuleType)) or f"{name}.{attr}" in NOT_DERIVED:
                continue
            _held(value, f"{name}.{attr}", 0, set(), found)
    assert not found, f"module globals holding tensors: {found}"
    del kept


def test_a_caches_tables_are_freed_with_the_cache():
    """A cache's codebooks (calibrated ones here: the theoretical codebooks' tables are shared by every cache) and
    their tables die with the cache."""
    import transformers

    class Calibrated:  # a new Codebook per call, held by nothing but the cache
        def get(self, layer, kind, bits):
            return Codebook.from_centroids(theoretical_codebook(bits, 32).centroids * 1.25, bits)

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    model.set_attn_implementation("turboquant")
    cache = TurboQuantCache(config=model.config, residual_length=8, codebooks=Calibrated())
    with torch.no_grad():
        model(_ids(40), **with_cache(cache))
        model(_ids(1, 2), **with_cache(cache))
    layer = cache.layers[0].kv
    holders = [layer.k_codebook.derived, layer.v_codebook.derived]
    assert all(len(h) for h in holders), "the cache built no table: the test would prove nothing"
    tables = [h.find(k) for h in holders for k in h.keys() if isinstance(h.find(k), torch.Tensor)]
    refs = [weakref.ref(o) for o in (layer.k_codebook, layer.v_codebook, *holders, *tables)]
    del cache, layer, holders, tables
    gc.collect()
    assert not [r() for r in refs if r() is not None]


def test_a_pickle_or_deep_copy_of_a_used_quantizer_carries_no_table():
    had, orth, cbs, rope = _use_every_table()
    own = cbs[-1]  # not a theoretical codebook: its holder is its own
    fresh = Codebook.from_centroids(own.centroids.clone(), own.bits)
    assert len(pickle.dumps(own)) == len(pickle.dumps(fresh))
    had.to("meta")  # a copy on another device is no part of a pickle either
    assert not pickle.loads(pickle.dumps(had))._on and not copy.deepcopy(had)._on
    for obj in (had, orth, own, rope):
        for back in (pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj)):
            assert len(back.derived) == 0 and back.derived is not obj.derived
            assert torch.equal(back.theta if obj is rope else back.centroids if obj is own else back.matrix,
                               obj.theta if obj is rope else obj.centroids if obj is own else obj.matrix)
    # a theoretical codebook's copies find the one holder of its (bits, dim), as every new one does
    theo = cbs[2]
    for back in (pickle.loads(pickle.dumps(theo)), copy.deepcopy(theo), theoretical_codebook(5, 64)):
        assert back.derived is theo.derived
    bare = Codebook.from_centroids(theo.centroids, 5)
    assert len(theo.derived) and len(pickle.dumps(theo)) < len(pickle.dumps(bare)) + 16


def test_a_copy_on_another_device_shares_the_holder_keyed_by_device():
    from tq_hf_cache.quant.reference import _centroid_table, row_major_matrix

    own = Codebook.from_centroids(theoretical_codebook(4, 64).centroids * 1.5, 4)
    rot = make_rotation(64, 9)
    moved, rmoved = own.to(CPU), rot.to("meta")
    assert moved is not own and moved.derived is own.derived and rmoved.derived is rot.derived
    table = _centroid_table(moved, CPU)
    assert _centroid_table(own, CPU) is table
    meta = _centroid_table(own.to("meta"), torch.device("meta"))
    assert meta.device.type == "meta" and _centroid_table(own, CPU) is table
    pi = row_major_matrix(rot, 3)
    assert row_major_matrix(rmoved, 3).device.type == "meta" and row_major_matrix(rot, 3) is pi
    # a replaced codebook is another quantizer: a holder of its own
    import dataclasses

    other = dataclasses.replace(own, centroids=own.centroids * 2)
    assert other.derived is not own.derived


@pytest.mark.skipif(not IS_V5, reason="TurboQuantStaticCache needs transformers >= 5")
def test_a_static_layer_builds_the_tables_of_every_quantizer_its_ids_name():
    """A copy's codebooks hold tables of their own, and its ids resolve to the original's while those live: binding
    the copy builds the fused path's tables of both, so that neither is built inside a captured graph later."""
    import transformers

    from tq_hf_cache import TurboQuantStaticCache

    class Calibrated:
        def __init__(self):
            self.made = {}

        def get(self, layer, kind, bits):
            key = (layer, kind, bits)
            if key not in self.made:
                self.made[key] = Codebook.from_centroids(theoretical_codebook(bits, 32).centroids * 1.25, bits)
            return self.made[key]

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    cache = TurboQuantStaticCache(config=model.config, max_cache_len=64, residual_length=8, codebooks=Calibrated())
    static_logits(model, cache, _ids(41), 40, "turboquant")
    twin = copy.deepcopy(cache)
    mine, its = (layer.kv for layer in (cache.layers[0], twin.layers[0]))
    assert its.k_codebook.derived is not mine.k_codebook.derived and twin.layers[0].packed.k_codebook is mine.k_codebook
    for cb in (mine.k_codebook, mine.v_codebook, its.k_codebook, its.v_codebook):
        names = {key[0].rsplit(".", 1)[-1] for key in cb.derived.keys()}
        assert {"lookup_table", "_symmetric"} <= names, names
