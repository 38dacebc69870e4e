"""The disk cache of kernels compiled at first use (a cubin for the GPU, a shared library for the CPU).

It lives in $TQ_HF_CACHE_KERNEL_DIR, else ~/.cache/tq_hf_cache/kernels. An entry is named by the digest of what built
it (source, options, compiler, target), so an edited source never meets a stale binary, and binds its image to that
key: MAGIC, the SHA-256 of key + image, then the image. A truncated, corrupted or swapped entry is not used (it is
built again and replaced, with a warning naming the file); an unwritable cache costs a build per process.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Callable

from .._io import write_bytes


def cache_dir() -> str:
    return os.environ.get("TQ_HF_CACHE_KERNEL_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tq_hf_cache",
                                                                      "kernels")


def key_of(*parts) -> str:
    """The entry key of what builds an image (any reprs)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _digest(key: str, image: bytes) -> bytes:
    return hashlib.sha256(key.encode() + image).digest()


def cached(name: str, key: str, magic: bytes, build: Callable[[], bytes]) -> bytes:
    """The image of entry `name` (a file name under `cache_dir()`, which should contain `key`): read back when the
    entry is sound, else `build()` and stored atomically."""
    path = os.path.join(cache_dir(), name)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        raw = None
    if raw is not None:
        head, digest, image = raw[: len(magic)], raw[len(magic): len(magic) + 32], raw[len(magic) + 32:]
        if head == magic and digest == _digest(key, image):
            return image
        warnings.warn(f"tq_hf_cache: the cached kernel {path} does not match its digest (truncated, corrupted or "
                      "another file); building it again", RuntimeWarning, stacklevel=3)
    image = build()
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        write_bytes(path, magic + _digest(key, image) + image)
    except OSError:
        pass
    return image
