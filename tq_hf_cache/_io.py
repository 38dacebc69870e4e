"""Safe file writes (every file the package writes goes through here) and guarded JSON reads.

A write goes to a fresh temporary name in the target's folder (`tempfile.mkstemp`: O_CREAT | O_EXCL, so a planted
file or symlink of that name is never followed), is flushed to disk, given the mode a plain `open(path, "w")` would
give under the process umask, then renamed over the target (`os.replace`: a reader sees the old file or the new one,
never a part). A symlink at the target itself is replaced, not written through.

JSON the package reads goes through `parse_json` / `read_json`: Python's parser recurses once per nesting level, so a
deeply nested file would end in a RecursionError (or a value too deep to print); it is a ValueError naming the file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
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


def write_bytes(path: str, data: bytes, mode: int | None = None) -> str:
    """Write `data` to `path` atomically (see the module docstring); returns `path`. `mode`: the file's mode
    whatever the umask (e.g. 0o600 for a file only its owner may change), else `file_mode()`."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), file_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return path


def write_text(path: str, text: str) -> str:
    """`write_bytes` of UTF-8 text."""
    return write_bytes(path, text.encode("utf-8"))


MAX_JSON_DEPTH = 64  # arrays / objects inside one another; the package's own files nest fewer than 10
_JSON_STRING = r'"[^"\\]*(?:\\.[^"\\]*)*"'
_JSON_TOKEN = re.compile(_JSON_STRING + r'(\s*:)?|[\[\]{}]')
_NOT_BRACKET = re.compile(_JSON_STRING + r'|[^"\[\]{}]+')
_EMPTY_PAIR = re.compile(r"\[\]|\{\}")


def _too_deep(text: str) -> tuple[int, str | None] | None:
    """(offset, top-level field or None) of the first array / object nested deeper than MAX_JSON_DEPTH, else None.
    Without recursion: the brackets outside strings lose their innermost pairs once per level (a pass in C each);
    only a text still nested after MAX_JSON_DEPTH passes is walked bracket by bracket, to say where."""
    bare = _NOT_BRACKET.sub("", text)
    for _ in range(MAX_JSON_DEPTH):
        peeled = _EMPTY_PAIR.sub("", bare)
        if peeled == bare:  # all peeled, or unbalanced (json.loads names where)
            return None
        bare = peeled
    if not bare:
        return None
    depth, field = 0, None
    for m in _JSON_TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return m.start(), field
        elif c in "]}":
            depth -= 1
        elif m.group(1) and depth == 1:
            key = c[: m.start(1) - m.start()]
            try:
                field = json.loads(key)
            except ValueError:
                field = key[1:-1]
    return None


def parse_json(text: str | bytes, where: str):
    """The value of JSON `text` (bytes: UTF-8); invalid or too deeply nested JSON (see `MAX_JSON_DEPTH`) is a
    ValueError naming `where` (and the top-level field that holds the nesting), never a RecursionError."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{where} is corrupt (not valid JSON): {e}") from None
    deep = _too_deep(text)
    if deep is not None:
        at, field = deep
        inside = f" in field {field!r}" if field is not None else ""
        raise ValueError(f"{where} is corrupt: its JSON nests arrays/objects deeper than {MAX_JSON_DEPTH} levels"
                         f"{inside} (at character {at}); at most {MAX_JSON_DEPTH} are read")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{where} is corrupt (not valid JSON): {e}") from None


def read_json(path: str):
    """`parse_json` of a UTF-8 file's text (naming `path`); a file that is not UTF-8 is a ValueError too."""
    with open(path, "rb") as f:
        return parse_json(f.read(), path)


def safetensors_bytes(tensors: dict, metadata: dict[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file of CPU-contiguous copies of `tensors`."""
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


DIGEST_BLOCK = 1 << 24  # 16 MiB


def sha256_blocks(data) -> str:
    """SHA-256 of the concatenated SHA-256 digests of `data`'s 16 MiB blocks (bytes, or a buffer such as an mmap).
    The blocks are hashed on threads (hashlib releases the GIL), so a GB-sized file is checked in a fraction of
    the time one SHA-256 stream takes."""
    from concurrent.futures import ThreadPoolExecutor

    view = memoryview(data).cast("B")
    blocks = [view[i: i + DIGEST_BLOCK] for i in range(0, len(view), DIGEST_BLOCK)] or [view]
    workers = max(1, min(len(blocks), os.cpu_count() or 1, 16))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(lambda b: hashlib.sha256(b).digest(), blocks))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def sha256_file(path: str) -> str:
    """SHA-256 of a file's bytes, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def read_private(path: str, follow_links: bool = True):
    """A file's bytes read whole into private memory (a uint8 numpy array): what is hashed is what is parsed, and a
    file truncated or rewritten while it is read is a ValueError naming it, never a SIGBUS (as a mapping gives).
    `follow_links=False`: a symbolic link at `path` is an OSError, not followed."""
    import torch

    fd = os.open(path, os.O_RDONLY | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0)))
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        buf = torch.empty(size, dtype=torch.uint8).numpy()
        got = f.readinto(memoryview(buf)) if size else 0
        if got != size or f.read(1):
            raise ValueError(f"{path} changed size while it was read ({size} bytes, then {got}); read it again")
    return buf


_SAFETENSORS_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
                       "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def safetensors_layout(data, where: str) -> tuple[int, dict]:
    """(where the tensors' bytes begin, {name: (torch dtype, shape, start, end)}: byte offsets from that point) of a
    safetensors file's bytes, each entry checked (a known dtype, whole non-negative sizes, offsets inside the file
    that hold exactly the shape's bytes). A malformed file is a ValueError naming `where` and what is wrong."""
    import torch

    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise ValueError(f"{where} is not a safetensors file: {len(view)} bytes, fewer than its 8-byte header size")
    n = int.from_bytes(view[:8], "little")
    if n > len(view) - 8:
        raise ValueError(f"{where} is not a safetensors file: its header claims {n} bytes, the file has {len(view)}")
    header = parse_json(bytes(view[8: 8 + n]), f"{where}: the safetensors header")
    if not isinstance(header, dict):
        raise ValueError(f"{where}: the safetensors header is not a JSON object")
    base, size, out = 8 + n, len(view) - 8 - n, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype")) if ok else None
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
        ok = (dtype is not None and isinstance(shape, list) and all(_count(s) for s in shape)
              and isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
              and offsets[0] <= offsets[1] <= size)
        if ok:
            dtype = getattr(torch, dtype)
            numel = 1
            for s in shape:
                numel *= s
            ok = offsets[1] - offsets[0] == numel * dtype.itemsize
        if not ok:
            raise ValueError(f"{where}: the safetensors entry of tensor {name!r} is malformed: {entry!r}")
        out[name] = (dtype, shape, offsets[0], offsets[1])
    return base, out


def parse_safetensors(data, where: str, device=None, copy: bool = True) -> dict:
    """The tensors of a safetensors file's bytes (`read_private`), each copied once: to `device`, or into its own CPU
    memory. `copy=False` (CPU only): views of `data` itself (a copy where a tensor's offset does not suit its dtype),
    for a caller that copies them out at once. A malformed file is a ValueError naming `where` and what is wrong."""
    import torch

    base, layout = safetensors_layout(data, where)
    out = {}
    for name, (dtype, shape, start, end) in layout.items():
        nbytes = end - start
        raw = (torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=base + start) if nbytes
               else torch.empty(0, dtype=torch.uint8))
        if device is not None:
            raw = raw.to(device)
        elif copy or (base + start) % dtype.itemsize:  # (a view of the file needs an aligned offset)
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape)
    return out


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


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
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(path) and not os.path.islink(path):
            raise FileExistsError(errno.EEXIST, f"{path!r} was created by another writer while this one wrote it; "
                                  "it holds that writer's files (write again to replace them)", path) from None
        raise
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
