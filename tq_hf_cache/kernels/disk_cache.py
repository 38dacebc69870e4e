"""The disk cache of kernels compiled at first use (a cubin for the GPU, a shared library for the CPU).

It lives in $TQ_HF_CACHE_KERNEL_DIR, else ~/.cache/tq_hf_cache/kernels. An entry is named by the digest of what built
it (source, options, compiler, target), so an edited source never meets a stale binary, and binds its image to that
key: MAGIC, the SHA-256 of key + image, then the image. A truncated, corrupted or swapped entry is not used (it is
built again and replaced, with a warning naming the file); an unwritable cache costs a build per process. Entries and
folders that another user owns, or that anyone may write, are not used (they could hold anyone's code).
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


def _foreign(st: os.stat_result) -> bool:
    """Whether a cache file or folder could hold another user's code: owned by someone else, or writable by anyone
    (group-writable is allowed: a umask of 002 gives that to one's own files where each user has a group)."""
    return hasattr(os, "geteuid") and (st.st_uid != os.geteuid() or bool(st.st_mode & 0o002))


def _read(path: str) -> bytes | None:
    """The entry's bytes, or None when it is missing, a link, or not this user's (then with a warning)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if _foreign(os.fstat(fd)):
            warnings.warn(f"tq_hf_cache: the cached kernel {path} belongs to another user or anyone may write it; "
                          "not loading it (building it again)", RuntimeWarning, stacklevel=4)
            return None
        return f.read()


def cached(name: str, key: str, magic: bytes, build: Callable[[], bytes]) -> bytes:
    """The image of entry `name` (a file name under `cache_dir()`, which should contain `key`): read back when the
    entry is sound, else `build()` and stored atomically. A cache folder that another user owns or anyone may write
    is not used at all: what it holds could be anyone's code."""
    folder = cache_dir()
    path = os.path.join(folder, name)
    try:
        usable = not _foreign(os.stat(folder))
    except OSError:
        usable = True  # not there yet: made below, ours
    if not usable:
        warnings.warn(f"tq_hf_cache: the kernel cache {folder} belongs to another user or anyone may write it; "
                      "building kernels in memory only", RuntimeWarning, stacklevel=3)
        return build()
    raw = _read(path)
    if raw is not None:
        head, digest, image = raw[: len(magic)], raw[len(magic): len(magic) + 32], raw[len(magic) + 32:]
        if head == magic and digest == _digest(key, image):
            return image
        warnings.warn(f"tq_hf_cache: the cached kernel {path} does not match its digest (truncated, corrupted or "
                      "another file); building it again", RuntimeWarning, stacklevel=3)
    image = build()
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        write_bytes(path, magic + _digest(key, image) + image)
    except OSError:
        pass
    return image
