"""Fuzzing saved prefixes: every damaged, edited, mixed or truncated prefix folder is refused with a ValueError (a
FileNotFoundError for a missing file) that names the file, and for the index the field, or it loads to exactly the
saved state (every tensor and length, and the logits of the next steps). Nothing in between, no other exception.

The folders are saved once per module; each example mutates a fresh copy. `test_fuzz` runs each mutation kind under
hypothesis, `test_fixed_seed_mutations` a seeded loop of known size; `-m slow` runs many more examples. Run with
`-s` for the count of each kind and outcome; TQ_FUZZ_COUNTS=path writes them as JSON.
"""

import collections
import copy
import json
import os
import random
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config, with_cache
from test_prefix import reseal
from tq_hf_cache import TurboQuantCache, TurboQuantLayer
from tq_hf_cache.prefix.file import PREFIX_JSON, PREFIX_TENSORS

FILES = (PREFIX_JSON, PREFIX_TENSORS)
NEXT_TOKENS = torch.tensor([[5, 9, 17, 33, 65]])
DEFAULT_EXAMPLES, SLOW_EXAMPLES, FIXED_SEED_PER_KIND = 40, 400, 25
# a save fsyncs each file: the kind that saves runs fewer examples
SAVING_KIND = "symlinked temp names"
SAVING_EXAMPLES, SAVING_SLOW_EXAMPLES, SAVING_FIXED_SEED = 8, 80, 5
COUNTS: collections.Counter = collections.Counter()


# ---- the saved prefixes --------------------------------------------------------------------------------------------


def _split_spec(cfg, sizes=(8, 24), bits=(5, 3)):
    g = torch.Generator().manual_seed(3)
    return {i: {"bits": list(bits), "sizes": list(sizes),
                "order": [torch.randperm(sum(sizes), generator=g).tolist() for _ in range(cfg.num_key_value_heads)]}
            for i in range(cfg.num_hidden_layers)}


def _ids(batch, length, seed):
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


class Saved:
    """A prefix saved into `folder`, with what it takes to load and judge it."""

    def __init__(self, root, name, model, cfg, x, bound, preset=None, **cache_kw):
        self.name, self.model, self.cfg, self.x, self.bound = name, model, cfg, x, bound
        self.folder = os.path.join(root, name)
        self.cache = TurboQuantCache(preset, config=cfg, **cache_kw)
        with torch.no_grad():
            model(x, **with_cache(self.cache))
        self.save(self.folder)
        self.state = state(self.cache)
        self.logits = next_logits(model, copy.deepcopy(self.cache), x.shape[0])

    def save(self, folder):
        self.cache.save_prefix(folder, self.x, **({"model": self.model} if self.bound else {}))

    def load(self, folder):
        return TurboQuantCache.load_prefix(folder, self.cfg, token_ids=self.x, model=self.model if self.bound else None)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("prefixes"))
    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=3)
    model = LlamaForCausalLM(cfg).eval()
    kw = dict(residual_length=4, sink_tokens=2, skip_layers=[1])
    out = {
        # quantized history beyond the residual window beside a full-precision layer; "twin" differs in tokens only
        "plain": Saved(root, "plain", model, cfg, _ids(1, 20, 0), True, **kw),
        "twin": Saved(root, "twin", model, cfg, _ids(1, 20, 1), True, **kw),
        # split keys and key centring, batch 2, saved without model=
        "split": Saved(root, "split", model, cfg, _ids(2, 19, 2), False, preset="k4v2", residual_length=4,
                       key_split=_split_spec(cfg), key_centering=True),
    }
    yield out
    print_counts()


# ---- the oracle -------------------------------------------------------------------------------------------------


def state(cache) -> dict:
    """Every tensor and length a loaded cache must reproduce, by name."""
    out = {"seq": cache.get_seq_length()}
    for i, layer in enumerate(cache.layers):
        p = f"{i}."
        out[p + "class"] = type(layer).__name__
        if isinstance(layer, TurboQuantLayer):
            out[p + "init"] = layer.is_initialized
            if not layer.is_initialized:
                continue
            out.update({p + name: t for name, t in layer.kv.state().items()})
            out.update({p + "lengths": tuple(layer.kv.lengths().values()),
                        p + "bits": (layer.key_bits, layer.value_bits, str(layer.norm_dtype), str(layer.dtype))})
        else:
            out.update({p + "keys": layer.keys, p + "values": layer.values,
                        p + "cum": getattr(layer, "cumulative_length", None)})
    return out


def same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor):
            if not isinstance(w, torch.Tensor) or v.dtype != w.dtype or v.shape != w.shape or not torch.equal(v, w):
                return False
        elif v != w:
            return False
    return True


@torch.no_grad()
def next_logits(model, cache, batch):
    return [model(NEXT_TOKENS[:, i : i + 1].expand(batch, 1), **with_cache(cache)).logits
            for i in range(NEXT_TOKENS.shape[1])]


def judge(kind: str, saved: Saved, folder: str, files=FILES, names=(), config_may_differ=False) -> str:
    """Load `folder`: refused naming the folder and one of `files` (and one of `names`, when given), or exactly the
    saved state."""
    files = (files,) if isinstance(files, str) else files
    try:
        loaded = saved.load(folder)
    except (ValueError, FileNotFoundError) as e:
        msg = str(e)
        assert folder in msg and any(f in msg for f in files), f"{kind}: the refusal names none of {files}: {msg}"
        if names:
            assert any(n in msg for n in names), f"{kind}: the refusal names none of {names}: {msg}"
        COUNTS[kind, "refused"] += 1
        return "refused"
    got = state(loaded)
    assert same_state(got, saved.state), f"{kind}: loaded a state other than the saved one"
    if not config_may_differ:
        assert loaded.tq_config == saved.cache.tq_config, f"{kind}: loaded another TurboQuantConfig"
    logits = next_logits(saved.model, loaded, saved.x.shape[0])
    assert all(torch.equal(a, b) for a, b in zip(logits, saved.logits)), f"{kind}: other next-token logits"
    COUNTS[kind, "exact"] += 1
    return "exact"


# ---- mutations: each takes `r` (choice(seq), randint(a, b)) and a fresh copy of the folder -----------------------


def json_paths(node, at=()):
    """Every path into the index: dict keys and list indices."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append(at + (k,))
        out += json_paths(v, at + (k,))
    return out


def render(path) -> str:
    """A field path as the loader's messages write it: layers[0].dtype."""
    s = ""
    for k in path:
        s += f"[{k}]" if isinstance(k, int) else (f".{k}" if s else k)
    return s


def field_names(path) -> tuple:
    """What a refusal of an edit at `path` may name: the field, the object holding it, or (an edit that keeps the
    schema) the index's own digest; inside tq_config, the section (TurboQuantConfig's message names the rest)."""
    if path[0] == "tq_config":
        return ("tq_config", "index_sha256")
    return tuple(render(path[:n]) for n in range(len(path), 0, -1)) + ("index_sha256",)


def _edit_json(folder, edit):
    p = os.path.join(folder, PREFIX_JSON)
    with open(p) as f:
        doc = json.load(f)
    doc = edit(doc) or doc
    with open(p, "w") as f:
        json.dump(doc, f, indent=1)


def _at(doc, path):
    for k in path[:-1]:
        doc = doc[k]
    return doc


def m_truncate(r, s, folder):
    file = r.choice(FILES)
    p = os.path.join(folder, file)
    size = os.path.getsize(p)
    with open(p, "rb") as f:
        data = f.read(r.randint(0, size - 1))
    with open(p, "wb") as f:
        f.write(data)
    return judge("truncate", s, folder, file)


def m_flip(r, s, folder):
    file = r.choice(FILES)
    p = os.path.join(folder, file)
    data = bytearray(open(p, "rb").read())
    for _ in range(r.randint(1, 3)):
        data[r.randint(0, len(data) - 1)] ^= r.randint(1, 255)
    open(p, "wb").write(bytes(data))
    return judge("byte flip", s, folder, file)


def m_delete(r, s, folder):
    doc = json.load(open(os.path.join(folder, PREFIX_JSON)))
    path = r.choice(json_paths(doc))
    _edit_json(folder, lambda d: _at(d, path).__delitem__(path[-1]))
    return judge("delete field", s, folder, PREFIX_JSON, field_names(path))


def _other_type(r, v):
    options = [str(v), [v], {"v": v}, None, True, False, 10**30, -1, -(10**30), 1.5, "", 0]
    if isinstance(v, list):
        options.append({str(i): x for i, x in enumerate(v)})
    if isinstance(v, dict):
        options.append(list(v.values()))
    if isinstance(v, int) and not isinstance(v, bool):
        options.append(-v)
    return r.choice(options)


def m_retype(r, s, folder):
    doc = json.load(open(os.path.join(folder, PREFIX_JSON)))
    path = r.choice(json_paths(doc))
    new = _other_type(r, _at(doc, path)[path[-1]])

    def edit(d):
        _at(d, path)[path[-1]] = new
    _edit_json(folder, edit)
    return judge("change type", s, folder, PREFIX_JSON, field_names(path))


def m_swap(r, prefixes, s, folder):
    """One file of the folder replaced by another prefix's: the same config and length ("twin"), or another."""
    partner = prefixes["twin"] if s.name == "plain" else prefixes[r.choice(["plain", "twin"])]
    if s.name == "plain" and r.randint(0, 1):
        partner = prefixes["split"]
    file = r.choice(FILES)
    shutil.copy(os.path.join(partner.folder, file), os.path.join(folder, file))
    return judge("swap files", s, folder, file)


def m_remove(r, s, folder):
    file = r.choice(FILES)
    os.remove(os.path.join(folder, file))
    return judge("remove file", s, folder, file)


def m_symlinks(r, s, folder):
    """Symlinks at the old fixed temporary names and likely new ones, in the folder and beside it; then a save
    into the existing folder and one into a new folder. The link target is never written."""
    parent = os.path.dirname(folder)
    victim = os.path.join(parent, "victim")
    with open(victim, "w") as f:
        f.write("untouched")
    fresh = os.path.join(parent, "fresh")
    names = [f"{d}{n}{t}" for n in FILES for d in ("", ".") for t in (".tmp", ".tmp.tmp", ".partial", ".new")]
    links = [os.path.join(folder, n) for n in names if r.randint(0, 1)]
    links += [os.path.join(parent, n) for n in (".fresh.tmp", "fresh.tmp", ".fresh") if r.randint(0, 1)]
    for link in links:
        os.symlink(victim, link)
    s.save(folder)
    s.save(fresh)
    assert open(victim).read() == "untouched"
    assert all(os.path.islink(link) and os.readlink(link) == victim for link in links)
    judge("symlinked temp names", s, fresh, PREFIX_JSON)
    return judge("symlinked temp names", s, folder, PREFIX_JSON)


_STRINGS = ["float16", "bfloat16", "float32", "turboquant", "plain", "TurboQuantLayer", "TurboQuantSlidingLayer",
            "DynamicLayer", "DynamicSlidingWindowLayer", "llama", "0" * 64, "f" * 64]


# no stored tensor shows these: they rest on index_sha256 alone (the kinds that do not reseal)
UNSHOWN = ("index_sha256", "residual_length")


def m_resealed_value(r, s, folder):
    """A value changed within its type, then both digests recomputed: the cross-checks must refuse it, or the
    state must be the saved one."""
    doc = json.load(open(os.path.join(folder, PREFIX_JSON)))
    leaves = [p for p in json_paths(doc) if isinstance(_at(doc, p)[p[-1]], (int, str)) and p[-1] not in UNSHOWN]
    path = r.choice(leaves)
    old = _at(doc, path)[path[-1]]
    if isinstance(old, bool):
        new = not old
    elif isinstance(old, int):
        new = max(0, old + r.choice([-3, -1, 1, 2, 5, 16]))
    else:
        new = r.choice(_STRINGS)

    def edit(d):
        _at(d, path)[path[-1]] = new
    reseal(folder, edit)
    return judge("resealed value", s, folder, config_may_differ=True)


def m_resealed_tensor(r, s, folder):
    """A tensor shortened, lengthened, retyped, removed or added, then both digests recomputed: refused, naming
    the tensor (or the index field that no longer fits)."""
    from safetensors.torch import load_file

    names = sorted(load_file(os.path.join(folder, PREFIX_TENSORS)))
    name = r.choice(names)
    how = r.choice(["shorter", "longer", "dtype", "remove", "extra", "batch"])

    def edit(t):
        x = t[name]
        if how == "shorter" and x.shape[2] > 0:
            t[name] = x[:, :, 1:].contiguous()
        elif how in ("longer", "shorter"):
            t[name] = torch.cat([x, x.new_zeros(*x.shape[:2], 1, *x.shape[3:])], dim=2)
        elif how == "dtype":
            t[name] = x.view(torch.int8) if x.dtype == torch.uint8 else x.to(
                torch.float16 if x.dtype != torch.float16 else torch.float32)
        elif how == "remove":
            del t[name]
        elif how == "extra":
            t[name.rsplit(".", 1)[0] + ".extra"] = torch.zeros(1)
        else:
            t[name] = torch.cat([x, x[:1]], dim=0)
    reseal(folder, None, edit)
    out = judge("resealed tensor", s, folder, names=(name, name.rsplit(".", 1)[0] + ".extra"))
    assert out == "refused", f"an edited tensor {name} ({how}) loaded"
    return out


KINDS = {
    "truncate": m_truncate, "byte flip": m_flip, "delete field": m_delete, "change type": m_retype,
    "swap files": None, "remove file": m_remove, "symlinked temp names": m_symlinks,
    "resealed value": m_resealed_value, "resealed tensor": m_resealed_tensor,
}


def run_one(kind, r, prefixes):
    """One mutation of a fresh copy of one of the saved folders."""
    s = prefixes[r.choice(["plain", "split"])]
    work = tempfile.mkdtemp(prefix="tq-fuzz-")
    try:
        folder = os.path.join(work, "prefix")
        shutil.copytree(s.folder, folder)
        if kind == "swap files":
            return m_swap(r, prefixes, s, folder)
        return KINDS[kind](r, s, folder)
    finally:
        shutil.rmtree(work)


class _Draws:
    """`choice` / `randint` over hypothesis' data, so one mutation serves both hypothesis and a seeded loop."""

    def __init__(self, data):
        self.data = data

    def choice(self, seq):
        return self.data.draw(st.sampled_from(list(seq)))

    def randint(self, a, b):
        return self.data.draw(st.integers(a, b))


def fuzz(kind, prefixes, examples):
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.data())
    def check(data):
        run_one(kind, _Draws(data), prefixes)

    check()


@pytest.mark.parametrize("kind", KINDS)
def test_fuzz(prefixes, kind):
    fuzz(kind, prefixes, SAVING_EXAMPLES if kind == SAVING_KIND else DEFAULT_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_fuzz_many(prefixes, kind):
    fuzz(kind, prefixes, SAVING_SLOW_EXAMPLES if kind == SAVING_KIND else SLOW_EXAMPLES)


def test_fixed_seed_mutations(prefixes):
    """A seeded loop of a known number of mutations of each kind, whatever hypothesis chooses to run."""
    r = random.Random(1234)
    want = {kind: SAVING_FIXED_SEED if kind == SAVING_KIND else FIXED_SEED_PER_KIND for kind in KINDS}
    outcomes = collections.Counter()
    for kind, n in want.items():
        for _ in range(n):
            outcomes[kind] += run_one(kind, r, prefixes) in ("refused", "exact")
    assert outcomes == want


def test_the_saved_prefixes_load_exactly(prefixes):
    """The oracle's baseline: an untouched copy loads to the saved state (else every 'refused' would be vacuous)."""
    for s in prefixes.values():
        assert judge("untouched", s, s.folder, PREFIX_JSON) == "exact"


def print_counts():
    kinds = sorted({k for k, _ in COUNTS})
    lines = [f"{k:22s} refused {COUNTS[k, 'refused']:5d}  exact {COUNTS[k, 'exact']:5d}" for k in kinds]
    print("\nprefix fuzz counts (this run):\n" + "\n".join(lines))
    if os.environ.get("TQ_FUZZ_COUNTS"):
        with open(os.environ["TQ_FUZZ_COUNTS"], "w") as f:
            json.dump({f"{k} / {o}": n for (k, o), n in sorted(COUNTS.items())}, f, indent=1)
