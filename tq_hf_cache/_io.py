"""Safe file writes: every file the package writes goes through here.

A write goes to a fresh temporary name in the target's folder (`tempfile.mkstemp`: O_CREAT | O_EXCL, so a planted
file or symlink of that name is never followed), is flushed to disk, given the mode a plain `open(path, "w")` would
give under the process umask, then renamed over the target (`os.replace`: a reader sees the old file or the new one,
never a part). A symlink at the target itself is replaced, not written through.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading

_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process umask (os.umask can only be read by setting it; the lock keeps threads of this module apart)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode `open(path, "w")` gives a new file under the current umask."""
    return 0o666 & ~_umask()


def write_bytes(path: str, data: bytes) -> str:
    """Write `data` to `path` atomically (see the module docstring); returns `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), file_mode())
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return path


def write_text(path: str, text: str) -> str:
    """`write_bytes` of UTF-8 text."""
    return write_bytes(path, text.encode("utf-8"))


def safetensors_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file of CPU-contiguous copies of `tensors`."""
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str) -> str:
    """SHA-256 of a file's bytes, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def write_folder(path: str, files: dict[str, bytes]) -> str:
    """Write `files` (name -> bytes) as the folder `path`, all or nothing.

    A new folder is built beside `path` under a temporary name, then renamed to it: a reader sees no folder or the
    whole one. An existing folder's files are replaced one by one (each atomically, in the order given; other files
    in it are left alone), so a caller that binds its files together (a digest of one in another) must write the
    bound file last and check the binding when it reads.
    """
    path = os.path.abspath(path)
    if os.path.islink(path):
        raise ValueError(f"{path!r} is a symbolic link; write the folder where it points, or remove the link")
    if os.path.isdir(path):
        for name, data in files.items():
            write_bytes(os.path.join(path, name), data)
        return path
    if os.path.exists(path):
        raise ValueError(f"{path!r} exists and is not a folder")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        for name, data in files.items():
            write_bytes(os.path.join(tmp, name), data)
        os.rename(tmp, path)  # fails, rather than merging, if another writer made the folder meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def probe_writable(folder: str) -> str | None:
    """Why files cannot be written into `folder` (None when they can); creates it if needed. The probe is a fresh
    temporary file, removed at once."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tq-hf-cache-", suffix=".probe")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        return str(e)
    return None


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
