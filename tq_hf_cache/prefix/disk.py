"""The disk tier of a `PrefixStore`: one folder, taken by one store at a time, of self-describing packs.

A pack is one file holding the pages one insert sent to disk, one after another (a file per page made the file
system's own work the cost of a disk tier: creating a file took 0.04 to 0.5 ms on the disks tried). Each page in it
is laid out as a safetensors file (8-byte header size, JSON header, tensor bytes), whose metadata names the store's
namespace, the page's key and its parent's, the payload's other fields (a snapshot's layer infos), and the SHA-256
of the rest of its header and of its tensor bytes: a page is checked whole when it is read, and a new store adopts a
folder's pages from their headers alone. A pack is written to a temporary name and renamed, without an fsync: a
pack torn by a crash fails its pages' digests when read, and they are dropped like any damaged page. Reads go into
private memory, never through a mapping: a file truncated while it is read is an error, not a SIGBUS. A pack stays
until its last page leaves the store; the store counts its whole bytes until then.

The folder is locked (`flock` on `.lock`) while a store uses it: two stores (two processes, or two in one) would
evict each other's files. Files of another namespace (another model, config or codebooks) or format, files that do
not parse and writers' leftover temporary files are removed when a store takes the folder; other files are left
alone.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import _io

PAGE_FORMAT = "tq_hf_cache.prefix_page"
PAGE_VERSION = "3"
LOCK_NAME = ".lock"
SUFFIX = ".pack"
_OLD_SUFFIX = ".safetensors"  # one page a file (format version 1): removed when a store takes the folder
MAX_HEADER = 64 << 20
_KEY = re.compile(r"[0-9a-f]{64}")
_DTYPE_NAMES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8",
                torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.float64: "F64", torch.bool: "BOOL"}


class PageDamaged(ValueError):
    """A page file that is missing, unreadable, of the wrong size, or not the one its key names."""

    def __init__(self, key: str, path: str, why: str):
        super().__init__(f"{path}: {why}")
        self.key, self.path, self.why = key, path, why


class Loc(NamedTuple):
    """Where a page is on disk: its pack (a file of several pages), and its bytes' offset and size there."""

    pack: str
    offset: int
    size: int


@dataclass
class Found:
    """A page a store found in its folder: its key, parent key (None for a chain's first page), the payload's other
    fields, the bytes of its tensors and of its place in its pack, when the pack was written, where the page is and
    the pack's size."""

    key: str
    parent: str | None
    meta: dict
    tensor_bytes: int
    file_bytes: int
    mtime: float
    loc: Loc
    pack_bytes: int


class DiskTier:
    """The page files of one store in `folder`, which it holds locked until `close`.

    Example:
        >>> tier = DiskTier(folder, namespace)                                      # doctest: +SKIP
        >>> tier.write(key, None, {"k": torch.zeros(2, 3)}, {})                    # doctest: +SKIP
        >>> tensors, meta = tier.read(key)                                         # doctest: +SKIP
    """

    def __init__(self, folder: str, namespace: str):
        self.folder, self.namespace = os.path.abspath(folder), namespace
        if os.path.islink(self.folder):
            raise ValueError(f"disk_dir {folder!r} is a symbolic link; give the folder itself")
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        self._lock_fd = _take(self.folder)
        self._serial = itertools.count()
        self._templates: dict[tuple, tuple] = {}

    # ---- files ----

    def path(self, pack: str) -> str:
        """The file of a pack."""
        return os.path.join(self.folder, pack + SUFFIX)

    def file_bytes(self, key: str, parent: str | None, tensors: dict, meta: dict) -> int:
        """The bytes this page takes in a pack (tensors on any device, contiguous or not)."""
        return self._template(key, parent, tensors, meta)[3]

    def write_pack(self, pack: str, pages, between=None) -> dict[str, Loc]:
        """Write pages (an iterable of (key, parent key, tensors, other fields)) one after another into the new file
        of `pack`, atomically (a temporary name, then a rename); returns where each one is. `between()` is called
        after each page is laid out (where a writer may give way)."""
        parts, locs, at = [], {}, 0
        for key, parent, tensors, meta in pages:
            image = self._image(key, parent, tensors, meta)
            size = sum(len(x) for x in image)
            locs[key] = Loc(pack, at, size)
            parts += image
            at += size
            if between is not None:
                between()
        # a name of this writer's own, created exclusively (a planted file or link of that name is never followed);
        # tempfile.mkstemp took 20 times as long a file here
        tmp = os.path.join(self.folder, f".{pack[:16]}.{os.getpid()}.{threading.get_ident()}.{next(self._serial)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            with os.fdopen(fd, "wb", buffering=0) as f:
                _write_all(f, parts)
            os.replace(tmp, self.path(pack))
        except BaseException:
            _remove(tmp)
            raise
        return locs

    def read(self, key: str, loc: Loc) -> tuple[dict, dict]:
        """(tensors, the payload's other fields) of a page, read into private memory and checked whole; a
        PageDamaged naming its file and what is wrong otherwise."""
        path = self.path(loc.pack)
        data = torch.empty(loc.size, dtype=torch.uint8).numpy()
        read_at(key, path, loc.offset, memoryview(data))
        buf = torch.from_numpy(data)
        base, layout, meta = self.check(key, data, path)
        tensors = {name: buf[base + start: base + end].view(dtype).view(shape)
                   for name, (dtype, shape, start, end) in layout.items()}
        return tensors, meta

    def check(self, key: str, data, path: str) -> tuple[int, dict, dict]:
        """(where the tensor bytes begin, the tensors' layout, the payload's other fields) of a page file's bytes,
        after checking its header and digest; PageDamaged otherwise."""
        view = memoryview(data).cast("B")
        header, why = _parse_header(view, len(view))
        if header is not None:
            why = self._check_meta(key, header)
        if why is None:
            md = header["__metadata__"]
            unsigned = _json({**header, "__metadata__": {k: v for k, v in md.items() if k != "sha256"}})
            n = int.from_bytes(view[:8], "little")
            h = hashlib.sha256(unsigned)
            h.update(view[8 + n:])
            if h.hexdigest() != md["sha256"]:
                why = "its SHA-256 differs from its header's (damaged or changed after it was written)"
        if why is not None:
            raise PageDamaged(key, path, why)
        try:
            base, layout = _io.safetensors_layout(view, path)
        except ValueError as e:
            raise PageDamaged(key, path, str(e)) from None
        return base, layout, json.loads(header["__metadata__"]["meta"])

    def remove(self, pack: str) -> None:
        _remove(self.path(pack))

    def scan(self) -> tuple[list[Found], dict[str, int], int]:
        """The pages of this store's namespace in the folder's packs, from their headers (oldest pack first, each
        pack's pages in order), the size of each pack they are in, and how many other files of ours were removed
        (another namespace or format, unreadable, or a writer's leftover). A pack is read up to its first page
        that does not parse; the bytes after it stay counted in its size."""
        found, sizes, removed = [], {}, 0
        for name in sorted(os.listdir(self.folder)):
            full = os.path.join(self.folder, name)
            if name.startswith(".") and name.endswith(".tmp"):
                removed += _remove(full)
                continue
            pack = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name[: -len(_OLD_SUFFIX)]
            if not name.endswith((SUFFIX, _OLD_SUFFIX)) or not _KEY.fullmatch(pack):
                continue  # not a file of a store
            pages = self._pages_in(pack, full) if name.endswith(SUFFIX) else []
            if not pages:
                removed += _remove(full)
                continue
            found += pages
            sizes[pack] = pages[0].pack_bytes
        found.sort(key=lambda p: p.mtime)  # (stable: a pack's pages stay in order)
        return found, sizes, removed

    def close(self) -> None:
        """Release the folder (its files stay for the next store)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (closing the descriptor releases its flock)
            self._lock_fd = None

    # ---- internals ----

    def _template(self, key, parent, tensors, meta) -> tuple[bytes, bytes, bytes, int]:
        """A page layout's unsigned header cut around its key and parent (pre, mid, post: the header is
        pre + key + mid + parent + post), and its files' size. Made once per layout: an insert's pages share one."""
        layout = (tuple((n, t.dtype, tuple(t.shape)) for n, t in _ordered(tensors)), parent is None, len(key),
                  json.dumps(meta, sort_keys=True, separators=(",", ":")) if meta else "")
        cut = self._templates.get(layout)
        if cut is None:
            k, p = "0" * len(key), ("" if parent is None else "1" * len(parent))
            unsigned, data = self._header(k, p, tensors, meta)
            a = unsigned.index(b'"key":"' + k.encode()) + 7
            b = unsigned.index(b'"parent":"' + p.encode() + b'"') + 10
            size = 8 + len(_sign(unsigned, "0" * 64)) + data
            cut = (unsigned[:a], unsigned[a + len(k): b], unsigned[b + len(p):], size)
            if len(self._templates) > 256:
                self._templates.clear()
            self._templates[layout] = cut
        return cut

    def _header(self, key, parent, tensors, meta) -> tuple[bytes, int]:
        """The unsigned header's bytes (the form the digest covers: `_sign` adds the digest) and the tensor bytes'
        size."""
        entries, at = {}, 0
        for name, t in _ordered(tensors):
            n = t.numel() * t.element_size()
            entries[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
            at += n + (-n % 8)
        md = {"format": PAGE_FORMAT, "version": PAGE_VERSION, "namespace": self.namespace, "key": key,
              "parent": parent or "", "meta": json.dumps(meta, sort_keys=True, separators=(",", ":"))}
        return _json({**entries, "__metadata__": md}), at

    def _check_meta(self, key: str, header: dict) -> str | None:
        md = header.get("__metadata__")
        if not isinstance(md, dict) or set(md) != {"format", "version", "namespace", "key", "parent", "meta",
                                                   "sha256"}:
            return "its header has no page metadata"
        if (md["format"], md["version"]) != (PAGE_FORMAT, PAGE_VERSION):
            return f"format {md['format']!r} version {md['version']!r}, not {PAGE_FORMAT!r} {PAGE_VERSION!r}"
        if md["namespace"] != self.namespace:
            return "it belongs to another model, config or codebooks (field namespace)"
        if md["key"] != key:
            return f"it holds page {str(md['key'])[:16]}, not the page its name says (field key)"
        if md["parent"] != "" and not (isinstance(md["parent"], str) and _KEY.fullmatch(md["parent"])):
            return "field parent is not a page key"
        if not (isinstance(md["sha256"], str) and _KEY.fullmatch(md["sha256"])):
            return "field sha256 is not a SHA-256 digest"
        try:
            ok = isinstance(json.loads(md["meta"]), dict)
        except (TypeError, ValueError, RecursionError):
            ok = False
        return None if ok else "field meta is not a JSON object"

    def _image(self, key, parent, tensors, meta) -> list:
        """A page's bytes in a pack: the 8-byte header size, the signed header, each tensor padded to 8 bytes."""
        parts = []
        for _, t in _ordered(tensors):
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            parts += [memoryview(raw), bytes(-raw.nbytes % 8)]
        pre, mid, post, _ = self._template(key, parent, tensors, meta)
        unsigned = pre + key.encode("ascii") + mid + (parent or "").encode("ascii") + post
        h = hashlib.sha256(unsigned)
        for p in parts:
            h.update(p)
        header = _sign(unsigned, h.hexdigest())
        return [len(header).to_bytes(8, "little"), header, *parts]

    def _pages_in(self, pack: str, path: str) -> list[Found]:
        """A pack's pages of this store's namespace, from their headers alone (their tensors are checked when
        first read), up to the first that does not parse."""
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            return []
        out = []
        with os.fdopen(fd, "rb"):
            st = os.fstat(fd)
            at = 0
            while at + 8 <= st.st_size:
                head = os.pread(fd, 8, at)
                n = int.from_bytes(head, "little") if len(head) == 8 else -1
                if not 0 < n <= min(MAX_HEADER, st.st_size - at - 8):
                    break
                header, _ = _parse_header(memoryview(head + os.pread(fd, n, at + 8)), st.st_size - at)
                md = header.get("__metadata__") if header is not None else None
                if header is None or not isinstance(md, dict) or not _KEY.fullmatch(str(md.get("key"))) \
                        or self._check_meta(md["key"], header) is not None:
                    break
                try:
                    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
                    tensor_bytes = sum(int(v["data_offsets"][1]) - int(v["data_offsets"][0])
                                       for k, v in header.items() if k != "__metadata__")
                except (TypeError, KeyError, IndexError, ValueError):
                    break
                size = 8 + n + -(-max(ends, default=0) // 8) * 8
                if at + size > st.st_size:
                    break
                out.append(Found(md["key"], md["parent"] or None, json.loads(md["meta"]), tensor_bytes, size,
                                 st.st_mtime, Loc(pack, at, size), st.st_size))
                at += size
        return out


def read_at(key: str, path: str, offset: int, into: memoryview) -> None:
    """Read a page's bytes from its pack into private memory; PageDamaged when the file is gone or too short."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise PageDamaged(key, path, f"cannot be read ({e.strerror or e})") from None
    try:
        got = os.preadv(fd, [into], offset) if hasattr(os, "preadv") else _pread_into(fd, into, offset)
    except OSError as e:
        raise PageDamaged(key, path, f"cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if got != len(into):
        raise PageDamaged(key, path, f"ends {len(into) - got} bytes before the page's end (truncated)")


def _pread_into(fd: int, into: memoryview, offset: int) -> int:
    data = os.pread(fd, len(into), offset)
    into[: len(data)] = data
    return len(data)


def _take(folder: str) -> int:
    """The lock file's descriptor, holding the folder's exclusive lock; a ValueError naming the folder when another
    store holds it."""
    import fcntl

    path = os.path.join(folder, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise ValueError(f"disk_dir {folder!r} is in use by another PrefixStore (process {holder}): each store "
                             "needs a folder of its own (close() the other one, or give this one another folder)")
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _parse_header(view, size: int) -> tuple[dict | None, str | None]:
    """(the header object, None) of a page file's first bytes, or (None, what is wrong)."""
    if len(view) < 8:
        return None, f"{len(view)} bytes, fewer than a header"
    n = int.from_bytes(view[:8], "little")
    if not 0 < n <= min(MAX_HEADER, size - 8, len(view) - 8):
        return None, f"its header claims {n} bytes, the file has {size}"
    try:
        header = json.loads(bytes(view[8: 8 + n]))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, "its header is not valid JSON"
    return (header, None) if isinstance(header, dict) else (None, "its header is not a JSON object")


def _sign(unsigned: bytes, sha: str) -> bytes:
    """The header with its digest: the metadata's "sha256" field, between "parent" and "version" as sorted keys place
    it (the first '"version":' is the metadata's: "__metadata__" sorts before every tensor name, and quotes inside the
    "meta" string are escaped), padded with spaces to an 8-byte boundary."""
    at = unsigned.index(b',"version":"')
    text = unsigned[:at] + b',"sha256":"' + sha.encode("ascii") + b'"' + unsigned[at:]
    return text + b" " * (-(len(text) + 8) % 8)


def _write_all(f, parts: list) -> None:
    """Every part, in as few system calls as the OS takes (writev where there is one)."""
    parts = [p for p in parts if len(p)]
    if not hasattr(os, "writev"):
        for p in parts:
            f.write(p)
        return
    fd = f.fileno()
    while parts:
        n = os.writev(fd, parts[:1024])
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if n:
            parts[0] = memoryview(parts[0])[n:]


def _ordered(tensors: dict) -> list:
    return sorted(tensors.items())


def _json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("ascii")


def _remove(path: str) -> int:
    try:
        os.remove(path)
        return 1
    except FileNotFoundError:
        return 0


class StagedReader:
    """Disk pages read for a GPU store: pages read (no mapping: no page faults) on threads into one of two
    host halves (pinned where CUDA is), each checked there; a full half is copied to its place in one device buffer
    while the other fills; each tensor is one strided view of that buffer. One restore at a time uses the halves
    (their own lock: a lookup of memory pages never waits here). A restore's peak is twice its bytes."""

    def __init__(self, disk: DiskTier, device, half_bytes: int):
        import threading

        self.disk, self.device = disk, torch.device(device)
        self._lock = threading.Lock()
        self._halves: list[torch.Tensor] = []
        self._make(half_bytes)

    def _make(self, nbytes: int) -> None:
        pin = torch.cuda.is_available()
        self._halves = []  # (the old halves go before bigger ones are made)
        self._halves = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]

    def read(self, locs: dict[str, Loc]) -> dict[str, dict]:
        """{key: {**meta, "tensors": ...} or tensors} of pages on disk, on the device; PageDamaged for a bad one."""
        from concurrent.futures import ThreadPoolExecutor

        keys = list(locs)
        with self._lock:
            paths = [self.disk.path(locs[k].pack) for k in keys]
            sizes = [locs[k].size for k in keys]
            padded = [-(-n // 8) * 8 for n in sizes]  # each file at an 8-byte boundary: its tensors stay aligned
            if not self._halves or self._halves[0].numel() < max(padded):
                self._make(max(self._halves[0].numel() if self._halves else 0, max(padded)))
            half = self._halves[0].numel()
            starts, groups = [0], [[]]  # files' places in the device buffer; runs of files that fit a half
            for i, n in enumerate(padded):
                if groups[-1] and starts[-1] + n - starts[groups[-1][0]] > half:
                    groups.append([])
                groups[-1].append(i)
                starts.append(starts[-1] + n)
            dev = torch.empty(max(starts[-1], 8), dtype=torch.uint8, device=self.device)
            cuda = self.device.type == "cuda"
            done = [None, None]  # each half's copy-finished event
            views = [memoryview(h.numpy()) for h in self._halves]

            def one(h: int, first: int, i: int):
                part = views[h][starts[i] - starts[first]: starts[i] - starts[first] + sizes[i]]
                read_at(keys[i], paths[i], locs[keys[i]].offset, part)
                return self.disk.check(keys[i], part, paths[i])

            parsed = [None] * len(keys)
            try:
                with ThreadPoolExecutor(max(1, min(16, os.cpu_count() or 1, len(keys)))) as pool:
                    for g, group in enumerate(groups):
                        h = g % 2
                        if done[h] is not None:
                            done[h].synchronize()  # this half's last copy has left it
                        first = group[0]
                        for i, res in zip(group, pool.map(lambda i: one(h, first, i), group)):
                            parsed[i] = res
                        n = starts[group[-1] + 1] - starts[first]
                        dev[starts[first]: starts[first] + n].copy_(self._halves[h][:n], non_blocking=cuda)
                        if cuda:
                            done[h] = torch.cuda.Event()
                            done[h].record(torch.cuda.current_stream(self.device))
            finally:
                for e in done:
                    if e is not None:
                        e.synchronize()  # the halves are free for the next restore, whatever happened
        return {key: _views(dev, at, base, layout, meta) for key, at, (base, layout, meta) in zip(keys, starts, parsed)}


def _views(dev: torch.Tensor, at: int, base: int, layout: dict, meta: dict) -> dict:
    """A page's tensors as views of the device buffer that holds its file at `at`."""
    tensors = {}
    for name, (dtype, shape, start, end) in layout.items():
        first = at + base + start
        if first % dtype.itemsize:  # (not from this store's writer: copied out)
            tensors[name] = dev[first: at + base + end].clone().view(dtype).view(shape)
            continue
        flat = dev[: dev.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        stride, acc = [], 1
        for n in reversed(shape):
            stride.append(acc)
            acc *= n
        tensors[name] = flat.as_strided(shape, stride[::-1], first // dtype.itemsize)
    return {**meta, "tensors": tensors} if meta else tensors
