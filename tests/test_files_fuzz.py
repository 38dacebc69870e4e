"""Fuzzing every file the package writes besides prefixes: each mutation is refused with a ValueError
(FileNotFoundError for a missing file) naming the file (and for JSON a field on the mutated path), or loads to
exactly the saved state; never anything in between, never another exception type.

Folders: calibrated codebooks under two seeds (config + codebooks), a config without codebooks, an allocation
(layer_bits + bit_allocation), a key split (key_split, key_centering). Mutation kinds: truncation, byte flip, JSON
field deletion, JSON type change (anywhere in the nested JSON), a file swapped in from another folder, a missing
file, and symlinks planted at the old fixed temporary names before a save. A fixed-seed loop of N mutations per
kind; the counts are printed (pytest -s) and asserted."""

import json
import os
import random
import shutil

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import tiny_llama_config
from tq_hf_cache import TurboQuantConfig
from tq_hf_cache.calibrate.calibration import CODEBOOKS_NAME, CalibratedCodebooks, calibrate
from tq_hf_cache.config import TURBOQUANT_CONFIG_NAME

N_FAST, N_SLOW = 12, 150
OLD_TEMP_NAMES = (TURBOQUANT_CONFIG_NAME + ".tmp", CODEBOOKS_NAME + ".tmp", ".tq-hf-cache-write-test")
COUNTS: dict[str, int] = {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=2)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(1))
    root = tmp_path_factory.mktemp("fuzz")
    saves = {}
    for seed in (0, 1):
        cb = calibrate(model, ids, TurboQuantConfig(key_bits=3, value_bits=2, residual_length=0, seed=seed),
                       bins=256, progress=False)
        saves[f"cal{seed}"] = lambda d, cb=cb: cb.save_pretrained(d)
    saves["plain"] = lambda d: TurboQuantConfig(residual_length=64).save_pretrained(d, model_config=cfg)
    saves["alloc"] = lambda d: TurboQuantConfig(layer_bits={0: [5, 3], 1: [3, 1]}).save_pretrained(
        d, model_config=cfg, extra={"bit_allocation": {"budget": 3.0, "sensitivity_kl": {"0": {"key": {"3": 0.1}}}}})
    g = torch.Generator().manual_seed(3)
    split = {i: {"bits": [6, 4], "sizes": [16, 16], "order": [torch.randperm(32, generator=g).tolist() for _ in range(2)]}
             for i in range(2)}
    saves["split"] = lambda d: TurboQuantConfig(key_split=split, key_centering=True).save_pretrained(
        d, model_config=cfg, extra={"key_split_calibration": {"sizes": [16, 16], "deltas": [1, -1]}})
    out = {}
    for name, save in saves.items():
        save(str(root / name))
        out[name] = (str(root / name), _state(str(root / name)), save)
    return out


def _state(d):
    """Everything a load gives: the config, and for codebook folders the model facts, entries, info, tensors."""
    cfg = TurboQuantConfig.from_pretrained(d).to_dict()
    if not os.path.exists(os.path.join(d, CODEBOOKS_NAME)):
        return cfg, None
    cb = CalibratedCodebooks.from_pretrained(d)
    return cfg, (cb.config.to_dict(), cb.model, cb.entries, cb.info,
                 {k: c.centroids.tolist() for k, c in sorted(cb.codebooks.items())})


def _outcome(d, saved, file_name, fields=(), missing=False):
    """'refused' or 'same'; fails on anything else."""
    try:
        state = _state(d)
    except FileNotFoundError as e:
        assert missing or CODEBOOKS_NAME in str(e), e  # a swapped-in config can index a codebooks file not there
        assert file_name in str(e) or CODEBOOKS_NAME in str(e), e
        return "refused"
    except ValueError as e:
        msg = str(e)
        assert file_name in msg or (missing and TURBOQUANT_CONFIG_NAME in msg), msg
        if fields:
            assert any(str(f) in msg for f in fields) or "sha256" in msg or "differs" in msg, (fields, msg)
        return "refused"
    assert state == saved, f"loaded a state other than the saved one after mutating {file_name} {fields}"
    return "same"


def _paths(node, path=()):
    yield path
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, path + (i,))


def _other_type(value, rng):
    choices = [None, True, 7, 2.5, "x", [], {}, [1], {"a": 1}]
    return rng.choice([c for c in choices if type(c) is not type(value)])


def _mutate(kind, d, rng, other):
    """Apply one mutation of `kind` in folder d; returns (file name, fields on the mutated path, missing)."""
    files = sorted(f for f in os.listdir(d) if not f.startswith("."))
    name = rng.choice(files)
    p = os.path.join(d, name)
    if kind == "truncate":
        data = open(p, "rb").read()
        open(p, "wb").write(data[: rng.randrange(len(data))])
    elif kind == "flip":
        data = bytearray(open(p, "rb").read())
        i = rng.randrange(len(data))
        data[i] ^= rng.randrange(1, 256)
        open(p, "wb").write(bytes(data))
    elif kind in ("delete", "retype"):
        name, p = TURBOQUANT_CONFIG_NAME, os.path.join(d, TURBOQUANT_CONFIG_NAME)
        doc = json.load(open(p))
        paths = [q for q in _paths(doc) if q and (kind == "retype" or True)]
        path = rng.choice(paths)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if kind == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = _other_type(parent[path[-1]], rng)
        open(p, "w").write(json.dumps(doc))
        return name, path, False
    elif kind == "swap":
        src = os.path.join(other, name)
        if not os.path.exists(src):
            os.remove(p)
            return name, (), True
        shutil.copy(src, p)
    elif kind == "missing":
        os.remove(p)
        return name, (), True
    return name, (), False


KINDS = ("truncate", "flip", "delete", "retype", "swap", "missing")
# a swap puts one file of another folder in: between the two calibrations, or a config with / without codebooks (a
# one-file folder swapped with another one-file folder is just that other folder)
PAIRS = {"cal0": ("cal1", "plain", "split"), "cal1": ("cal0", "alloc"), "plain": ("cal0", "cal1"),
         "alloc": ("cal0", "cal1"), "split": ("cal0", "cal1")}


def _fuzz(folders, tmp_path, n, seed):
    rng = random.Random(seed)
    counts = {}
    for kind in KINDS:
        for i in range(n):
            name = rng.choice(sorted(folders))
            src, saved, _ = folders[name]
            d = str(tmp_path / f"{kind}{i}")
            shutil.copytree(src, d)
            file_name, fields, missing = _mutate(kind, d, rng, folders[rng.choice(PAIRS[name])][0])
            result = _outcome(d, saved, file_name, fields, missing)
            counts[(kind, result)] = counts.get((kind, result), 0) + 1
            shutil.rmtree(d)
    return counts


def _symlinks(folders, tmp_path, n):
    """Symlinks at the old fixed temporary names: a save leaves their targets alone and loads as saved."""
    runs = 0
    for i in range(n):
        name = sorted(folders)[i % len(folders)]
        _, saved, save = folders[name]
        d = tmp_path / f"link{i}"
        d.mkdir()
        victim = tmp_path / f"victim{i}"
        victim.write_bytes(b"keep")
        for t in OLD_TEMP_NAMES:
            os.symlink(victim, d / t)
        save(str(d))
        assert victim.read_bytes() == b"keep"
        assert _state(str(d)) == saved
        runs += 1
    return runs


def _report(counts, links, n):
    by_kind = {k: sum(v for (kk, _), v in counts.items() if kk == k) for k in KINDS}
    assert all(by_kind[k] == n for k in KINDS), by_kind
    # the mutations must bite: most are refused (a mutation that leaves the state as saved is rare)
    assert sum(v for (k, r), v in counts.items() if r == "refused") >= len(KINDS) * n // 2, counts
    COUNTS.update({f"{k}/{r}": v for (k, r), v in sorted(counts.items())}, symlinks=links)
    print("fuzz counts:", json.dumps(COUNTS, sort_keys=True))


def test_every_mutation_is_refused_by_name_or_loads_as_saved(folders, tmp_path):
    counts = _fuzz(folders, tmp_path, N_FAST, seed=0)
    _report(counts, _symlinks(folders, tmp_path, len(folders)), N_FAST)


@pytest.mark.slow
def test_every_mutation_is_refused_by_name_or_loads_as_saved_many(folders, tmp_path):
    counts = _fuzz(folders, tmp_path, N_SLOW, seed=1)
    _report(counts, _symlinks(folders, tmp_path, 3 * len(folders)), N_SLOW)
