"""The disk cache of kernels compiled at first use (a cubin for the GPU, a shared library for the CPU).

It lives in $TQ_HF_CACHE_KERNEL_DIR, else ~/.cache/tq_hf_cache/kernels. An entry is named by the digest of what built
it (source, options, compiler, target), so an edited source never meets a stale binary, and binds its image to that
key: MAGIC, the SHA-256 of key + image, then the image. A truncated, corrupted or swapped entry is not used (it is
built again and replaced, with a warning naming the file); an unwritable cache costs a build per process.

That digest has no secret (the key is in the file name), so it guards against damage, not against a writer: whoever
may write an entry or its folder chooses the code this process loads. The folder is made 0700 and entries are written
0600 whatever the umask; an entry or folder that another user owns, or that group or others may write, is not loaded
(one warning per path, saying how to fix it). Such an entry of one's own (e.g. written under umask 002 by an older
release) is built again and replaced by an owner-only file.
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


ENTRY_MODE = 0o600
FOLDER_MODE = 0o700
_warned: set[str] = set()


def _unsafe(st: os.stat_result) -> str | None:
    """Why a cache file or folder could hold code this user did not write (owned by another user, or writable by
    group or others), else None."""
    if not hasattr(os, "geteuid"):
        return None
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"is writable by {who} (mode {st.st_mode & 0o777:o})"
    return None


def _warn_once(path: str, text: str, stacklevel: int) -> None:
    if path not in _warned:
        _warned.add(path)
        warnings.warn(text, RuntimeWarning, stacklevel=stacklevel + 1)


def _read(path: str) -> bytes | None:
    """The entry's bytes, or None when it is missing, a link, or unsafe (then with a warning: it is replaced)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        why = _unsafe(os.fstat(fd))
        if why:
            _warn_once(path, f"tq_hf_cache: the cached kernel {path} {why}; not loading it: building it again and "
                             f"replacing it with an owner-only (0{ENTRY_MODE:o}) file", stacklevel=4)
            return None
        return f.read()


def cached(name: str, key: str, magic: bytes, build: Callable[[], bytes]) -> bytes:
    """The image of entry `name` (a file name under `cache_dir()`, which should contain `key`): read back when the
    entry is sound, else `build()` and stored atomically, owner-only. A cache folder that another user owns or that
    group or others may write is not used at all: what it holds could be anyone's code."""
    folder = cache_dir()
    path = os.path.join(folder, name)
    try:
        why = _unsafe(os.stat(folder))
    except OSError:
        why = None  # not there yet: made below, ours
    if why:
        _warn_once(folder, f"tq_hf_cache: the kernel cache {folder} {why}; not using it (kernels are built in memory "
                           f"each process). Fix: `chmod go-w {folder}` if it is yours, or set TQ_HF_CACHE_KERNEL_DIR "
                           "to a folder only you may write", stacklevel=3)
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
        os.makedirs(folder, mode=FOLDER_MODE, exist_ok=True)
        write_bytes(path, magic + _digest(key, image) + image, mode=ENTRY_MODE)
    except OSError:
        pass
    return image
