"""A `PrefixStore`'s pages and snapshots as tensors: what a cache's state is cut into (`capture`), and how a cache is
built back from a chain of them (`restore`). Nothing here holds state or knows about tiers."""

from __future__ import annotations

import hashlib
import json

import torch

from ..config import model_facts
from .file import _restore_layer, _save_layer, state_digest
from ..state.layer_state import is_paged



def capture(cache, rows: torch.Tensor, static: bool, page_tokens: int) -> tuple[dict, list[dict], str, set, int]:
    """(tensors, layer infos, layout digest, paged tensor names, whole pages per row) of a cache holding `rows`."""
    if static:
        tensors, infos, paged = _static_state(cache, rows.shape[0])
        quantized = [rows.shape[1]]  # a static layer holds the codes of every position
    else:
        for layer in cache.layers:
            if getattr(layer, "is_initialized", False) and hasattr(getattr(layer, "kv", None), "settle"):
                layer.kv.settle()  # what a decode step left beyond the window, as a dense step leaves it
        tensors = {}
        infos = [_save_layer(layer, i, tensors, rows.shape[0]) for i, layer in enumerate(cache.layers)]
        infos = [{**info, "batch": 1} if "batch" in info else info for info in infos]
        # pages: the full-attention TurboQuant layers' packed tokens, which are the sequence's first ones (a
        # sliding layer's packed buffers begin wherever its window does: they go whole into the snapshot)
        tq = [i for i, info in enumerate(infos) if info.get("class") == "TurboQuantLayer" and info["initialized"]]
        paged = {n for n in tensors if is_paged(n) and n.startswith(tuple(f"layers.{i}." for i in tq))}
        quantized = [infos[i]["quantized"] for i in tq]
    m = (min(quantized) if quantized else 0) // page_tokens
    # the layer layout every row's endpoint is stored under (one for the batch: the rows share their layers)
    layout = hashlib.sha256(json.dumps(infos, sort_keys=True, default=str).encode()).hexdigest()
    return tensors, infos, layout, paged, m


def restore(cache, rows: list[list[dict]], config, device, static: bool):
    """Fill `cache` (new, empty) from the rows' chains (each: pages, then the snapshot), stacked along the batch."""
    snaps = [chain[-1] for chain in rows]
    if any(s["infos"] != snaps[0]["infos"] for s in snaps[1:]):
        raise ValueError("the rows' snapshots describe different layers: they cannot share one cache")
    facts = model_facts(config)
    doc = {"batch": len(rows), "num_tokens": snaps[0]["num_tokens"]}
    tensors = {}
    for name in snaps[0]["tensors"]:  # per row: pages then the snapshot's part, along the tokens
        per_row = []
        for chain in rows:
            parts = [p[name] for p in chain[:-1] if name in p] + [chain[-1]["tensors"][name]]
            if all(t.device.type == "cpu" and not t.is_pinned() for t in parts):
                # pages read from disk (or a CPU-only machine): joined here, then one copy, not one a page
                # (through pinned memory it was slower on the H100 host: 0.57 s against 0.43 for 1.1 GB)
                per_row.append(torch.cat(parts, dim=2).to(device))
            else:  # pinned or device pages: each copied asynchronously, joined by one kernel there
                per_row.append(torch.cat([t if t.device == device else t.to(device, non_blocking=True)
                                          for t in parts], dim=2))
        tensors[name] = torch.cat(per_row, dim=0) if len(per_row) > 1 else per_row[0]
    if static:
        _restore_static(cache, snaps[0]["infos"], tensors, len(rows), device)
        return cache

    def get(name, shape, dtype, i):
        t = tensors[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(f"the store's layer {i} tensor {name!r} is {tuple(t.shape)} {t.dtype}, expected "
                             f"{tuple(shape)} {dtype}")
        return t

    for i, (layer, info) in enumerate(zip(cache.layers, snaps[0]["infos"])):
        info = {**info, "batch": len(rows)} if "batch" in info else info
        _restore_layer(layer, i, info, doc, facts, get, "the prefix store", device)
    return cache


def rows_of(input_ids) -> torch.Tensor:
    """(batch, n) int64 token ids on the CPU, from (n,) or (batch, n)."""
    t = torch.as_tensor(input_ids).detach().cpu()
    if t.dim() == 1:
        t = t[None]
    if t.dim() != 2 or t.shape[0] == 0:
        raise ValueError(f"input_ids must be (n,) or (batch, n) token ids; got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def check_static(cache) -> None:
    from ..hf.static_cache import TurboQuantStaticLayer

    other = [(i, type(layer).__name__) for i, layer in enumerate(cache.layers)
             if not isinstance(layer, TurboQuantStaticLayer)]
    if other:
        raise ValueError(f"a PrefixStore of static caches takes models whose every layer is a quantized full-attention "
                         f"layer; layers {other[:4]} are not (use the store without max_cache_len)")


def _static_state(cache, batch: int) -> tuple[dict, list[dict], set]:
    """(tensors, infos, paged names) of a TurboQuantStaticCache: every layer's state (`FixedState.state`), the codes
    and norms cut to the positions held, the lengths in the infos."""
    check_static(cache)
    tensors, infos, paged = {}, [], set()
    for i, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            infos.append({"class": "TurboQuantStaticLayer", "initialized": False})
            continue
        if layer.batch_size != batch:
            raise ValueError(f"layer {i} holds batch {layer.batch_size} but token_ids has batch {batch}")
        state, lengths = layer.state(), layer.kv.lengths()
        for name, t in state.items():
            tensors[f"layers.{i}.{name}"] = t[:, :, : lengths["length"]] if is_paged(name) else t
            if is_paged(name):
                paged.add(f"layers.{i}.{name}")
        infos.append({"class": "TurboQuantStaticLayer", "initialized": True, "dtype": str(layer.dtype),
                      "heads": layer.num_heads, "head_dim": layer.k_head_dim, **lengths,
                      "digest": state_digest(layer.kv)})
    return tensors, infos, paged


def _restore_static(cache, infos: list[dict], tensors: dict, batch: int, device) -> None:
    """Write a snapshot's tensors into a fresh TurboQuantStaticCache's layers (each initialized to the stored shape)."""
    for i, (layer, info) in enumerate(zip(cache.layers, infos)):
        if not info["initialized"]:
            continue
        dtype = getattr(torch, info["dtype"].removeprefix("torch."))
        x = torch.zeros(batch, info["heads"], 1, info["head_dim"], dtype=dtype, device=device)
        layer.lazy_initialization(x, x)
        if state_digest(layer.kv) != info["digest"]:
            raise ValueError(f"the store's static layer {i} was quantized with other rotations or codebooks than this "
                             "cache's")
        prefix = f"layers.{i}."
        layer.kv.load_state({n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)},
                            {"length": info["length"], "exact_from": info["exact_from"]},
                            where=f"the store's layer {i}")


def binding(tensors: dict, paged: set) -> str:
    """What a row's pages are bound to besides their tokens: its key means (centred layers: a centred layer's codes
    depend on its mean, which the tokens of the cache's first quantized block set) and the dtype of every paged
    tensor (a layer whose norms widened to float32 stores other pages than one in float16), as a SHA-256: pages
    are shared only between rows of one binding, so a chain never mixes norm dtypes or means."""
    h = hashlib.sha256()
    for n in sorted(n for n in tensors if n.endswith(".key_mean")):
        h.update(n.encode() + tensors[n].detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    for n in sorted(paged):
        h.update(f"{n}:{tensors[n].dtype};".encode())
    return h.hexdigest()


def bind(keys: list[str], bound: str) -> list[str]:
    """The page keys of tokens' keys under a `binding`."""
    return [hashlib.sha256((k + bound).encode()).hexdigest() for k in keys]


def slice_pages(tensors: dict, paged: set, start: int, stop: int | None, rest: bool = False) -> dict:
    """Positions [start, stop) (axis 2) of the tensors named in `paged` (a page); with `rest`, also every other
    stored tensor whole (the snapshot's parts). Views: `_to` copies the pages the index stores, only those."""
    out = {}
    for name, t in tensors.items():
        if name in paged:
            out[name] = t[:, :, start:stop]
        elif rest:
            out[name] = t
    return out


def nbytes(payload: dict) -> int:
    """The bytes of a page's (or a snapshot's) tensors."""
    tensors = payload["tensors"] if "tensors" in payload else payload
    return sum(t.numel() * t.element_size() for t in tensors.values())


def to_device(payload: dict, device) -> dict:
    if "tensors" in payload:
        return {**payload, "tensors": to_device(payload["tensors"], device)}
    pin = device.type == "cpu" and torch.cuda.is_available()

    def copy(v):  # always a copy of its own: a page never holds on to (or aliases) a cache's buffer
        if pin:
            return torch.empty(v.shape, dtype=v.dtype, pin_memory=True).copy_(v)
        return v.to(device, copy=True)

    return {k: copy(v) for k, v in payload.items()}


def parts(payload: dict) -> tuple[dict, dict]:
    """(tensors, the other fields) of a page or snapshot, as they are (no copy)."""
    if "tensors" in payload:
        return payload["tensors"], {k: v for k, v in payload.items() if k != "tensors"}
    return payload, {}


def flatten(payload: dict) -> tuple[dict, dict]:
    """`parts`, every tensor contiguous on the CPU (as a file holds it)."""
    tensors, meta = parts(payload)
    return {k: v.contiguous().cpu() for k, v in tensors.items()}, meta


def unflatten(tensors: dict, meta: dict) -> dict:
    return {**meta, "tensors": tensors} if meta else tensors
