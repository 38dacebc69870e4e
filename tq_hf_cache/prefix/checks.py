"""What a `PrefixStore` refuses, by name and before anything changes: bad arguments, a cache of another kind, length
or config, and a cache whose layers were quantized with other rotations or codebooks than the store's (their codes
would decode to other vectors under the store's keys)."""

from __future__ import annotations

from typing import Callable

import torch

from .file import state_digest


def check_args(page_tokens, cpu_bytes, gpu_bytes, disk_dir, disk_bytes, device) -> torch.device:
    """Refuse bad arguments by name, before anything is made; returns the store's device."""
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, int) or page_tokens < 1:
        raise ValueError(f"page_tokens must be an integer >= 1, got {page_tokens!r}")
    for name, v in (("cpu_bytes", cpu_bytes), ("gpu_bytes", gpu_bytes), ("disk_bytes", disk_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an integer number of bytes >= 0, got {v!r}")
    if disk_dir is not None and not disk_bytes:
        raise ValueError(f"disk_dir={disk_dir!r} needs disk_bytes > 0 (the bytes of page files it may hold)")
    if disk_dir is None and disk_bytes:
        raise ValueError(f"disk_bytes={disk_bytes} needs disk_dir (the folder of the disk tier)")
    where = torch.device(device) if device is not None else torch.device("cpu")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} needs CUDA, which this torch does not have")
    if gpu_bytes and where.type != "cuda":
        raise ValueError(f"gpu_bytes={gpu_bytes} needs a CUDA device, got device={where}")
    return where


def check_cache(cache, rows: torch.Tensor, tq_config, max_cache_len: int | None) -> None:
    """`cache` is the kind of cache the store holds, holds exactly `rows`' tokens and was made under `tq_config`."""
    from ..hf.cache import TurboQuantCache
    from ..hf.static_cache import TurboQuantStaticCache

    want = TurboQuantCache if max_cache_len is None else TurboQuantStaticCache
    if not isinstance(cache, want) or getattr(cache, "capacity", None) != max_cache_len:
        raise TypeError(f"this store takes {want.__name__}s" + (f" of max_cache_len={max_cache_len}"
                        if max_cache_len else "") + f" (the caches match restores), got "
                        f"{type(cache).__name__}" + (f" of {cache.capacity}" if hasattr(cache, "capacity") else ""))
    if int(cache.get_seq_length()) != rows.shape[1]:
        raise ValueError(f"the cache holds {int(cache.get_seq_length())} tokens, input_ids {rows.shape[1]}: "
                         "insert a cache that prefilled exactly these tokens")
    mine, theirs = tq_config.to_dict(), cache.tq_config.to_dict()
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differ:
        raise ValueError("the cache was quantized under another config than the store's: "
                         + ", ".join(f"{k}={theirs.get(k)!r} (the store's {mine.get(k)!r})" for k in differ[:4]))


class QuantizerCheck:
    """Refuses layers quantized with other rotations or codebooks than a fresh cache of the store's has (another
    seed, rotation kind or calibration). Each layer's digest is made once, from a cache `new_cache` makes."""

    def __init__(self, new_cache: Callable, static: bool):
        self.new_cache, self.static = new_cache, static
        self._digests: dict[int, str] = {}

    def __call__(self, infos: list[dict]) -> None:
        for i, info in enumerate(infos):
            if "digest" in info and info["digest"] != self._digest(i, info):
                raise ValueError(f"layer {i} of the cache was quantized with other rotations or codebooks than the "
                                 "store's (seed, rotation kind or calibrated codebooks differ): build the cache with "
                                 "the store's tq_config and codebooks")

    def _digest(self, i: int, info: dict) -> str:
        if i not in self._digests:
            layer = self.new_cache().layers[i]
            dtype = getattr(torch, info["dtype"].removeprefix("torch."))
            x = torch.zeros(1, info["heads"], 1 if self.static else 0, info["head_dim"], dtype=dtype)
            layer.lazy_initialization(x, x)
            self._digests[i] = state_digest(layer.kv)
        return self._digests[i]
