"""C compiled at first use: the system's C compiler ($CC, else cc) turns `decode.c` into a shared library, cached on
disk (`kernels.disk_cache`) and loaded by ctypes. No build step at install; where no compiler works, `library()` raises
JitError and the callers keep the torch math.

OpenMP: compiled with -fopenmp, the library shares the process's libgomp (torch's, already loaded under that name);
a compiler without OpenMP gets a single-threaded build, with a warning.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

from .. import disk_cache

MAGIC = b"tq_hf_cache shared library 1\n"
_LOCK = threading.Lock()
_LIBS: dict = {}
_OPEN_FDS: list = []  # the anonymous files the libraries were loaded from (see _load)


class JitError(RuntimeError):
    """The CPU kernel cannot be built or loaded here (the reason is in the message)."""


def source() -> str:
    with open(os.path.join(os.path.dirname(__file__), "decode.c")) as f:
        return f.read()


def compiler() -> list[str]:
    """The C compiler's command ($CC may carry a wrapper or options, e.g. "ccache gcc")."""
    cmd = shlex.split(os.environ.get("CC") or "cc")
    path = shutil.which(cmd[0]) if cmd else None
    if path is None:
        raise JitError(f"no C compiler: {os.environ.get('CC') or 'cc'!r} is not on PATH (set CC to one)")
    return [path, *cmd[1:]]


def _version(cc: list[str]) -> str:
    """What identifies the compiler in the cache key: its resolved path and its version text."""
    try:
        out = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise JitError(f"the C compiler {' '.join(cc)} does not run: {e}") from None
    return f"{[os.path.realpath(cc[0]), *cc[1:]]} {out.stdout.strip()} {out.stderr.strip()}"


def arch_flags() -> list[str]:
    """Vector extensions this CPU has, as torch found them (AVX2 and FMA, which torch's AVX2 capability checks; the
    cache key names them: a cache shared between machines never hands one a library it cannot run)."""
    import torch

    if platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        return ["-mavx2", "-mfma"]
    return []


def compile_library(src: str, cc: list[str], flags: list[str]) -> bytes:
    """Compile `src` into a shared library image with `flags` (and -shared -fPIC); raises JitError with the compiler's
    output, or with the reason a temporary file could not be used."""
    try:
        with tempfile.TemporaryDirectory(prefix="tq_hf_cache_cc_") as tmp:
            c_path, so_path = os.path.join(tmp, "decode.c"), os.path.join(tmp, "decode.so")
            with open(c_path, "w") as f:
                f.write(src)
            cmd = [*cc, *flags, "-shared", "-fPIC", "-std=c11", c_path, "-o", so_path]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise JitError(f"the C compiler {' '.join(cc)} does not run: {e}") from None
            if out.returncode:
                raise JitError(f"the CPU decode kernel does not compile:\n$ {' '.join(cmd)}\n{out.stderr.strip()}")
            with open(so_path, "rb") as f:
                return f.read()
    except OSError as e:
        raise JitError(f"the CPU decode kernel cannot be compiled here: {e}") from None


def _load(image: bytes) -> ctypes.CDLL:
    """dlopen an image from an anonymous file (Linux), else from a private temporary folder: what is loaded is the
    image whose digest was checked, whatever happens to the cache file meanwhile. The anonymous file stays open for
    the process's life: its /proc/self/fd path is then never reused, and dlopen (which matches paths it has loaded
    before) cannot mistake another image for it."""
    if hasattr(os, "memfd_create") and sys.platform.startswith("linux"):
        fd = -1
        try:
            fd = os.memfd_create("tq_hf_cache_decode")
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(image)
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
            _OPEN_FDS.append(fd)
            return lib
        except OSError:  # no memfd, no /proc, or a memfd that may not be executed: the folder below
            if fd >= 0:
                os.close(fd)
    with tempfile.TemporaryDirectory(prefix="tq_hf_cache_so_") as tmp:
        path = os.path.join(tmp, "decode.so")
        with open(path, "wb") as f:
            f.write(image)
        return ctypes.CDLL(path)


def library() -> ctypes.CDLL:
    """The CPU decode library (built or read from the disk cache at the first call of the process). A failure is
    kept for the process: a missing compiler is not looked for again at every decode step."""
    with _LOCK:
        if "decode" not in _LIBS:
            try:
                _LIBS["decode"] = _build()
            except JitError as e:
                _LIBS["decode"] = e
        lib = _LIBS["decode"]
    if isinstance(lib, JitError):
        raise lib
    return lib


def _build() -> ctypes.CDLL:
    """With OpenMP where the compiler takes -fopenmp, else single-threaded (with a warning); each its own entry."""
    cc, src = compiler(), source()
    ident = _version(cc)
    errors = []
    for omp in (True, False):
        flags = ["-O3", *arch_flags(), *(["-fopenmp"] if omp else [])]
        key = disk_cache.key_of(src, flags, ident, platform.machine())
        try:
            image = disk_cache.cached(f"cpu_decode-{key}.so", key, MAGIC, lambda: compile_library(src, cc, flags))
        except JitError as e:
            errors.append(str(e))
            continue
        if not omp:
            warnings.warn(f"tq_hf_cache: the CPU decode kernel is built without OpenMP (single-threaded): "
                          f"{errors[0]}", RuntimeWarning, stacklevel=4)
        try:
            lib = _load(image)
            _declare(lib)
        except (OSError, AttributeError) as e:
            raise JitError(f"the CPU decode library does not load: {e}") from None
        return lib
    raise JitError("\n".join(errors))


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.tq_packed_scores.argtypes = [p, i64, i64, p, i64, p, i64, i64, p, i64, p, i64, i64, i32, i32, i32, i32, i32,
                                     i32, i32, i32]
    lib.tq_packed_values.argtypes = [p, i64, i64, p, i64, p, i64, i64, p, i64, p, i32, i32, i32, i32, i32, i32, i32]
    lib.tq_packed_scores.restype = lib.tq_packed_values.restype = lib.tq_vector_decode.restype = ctypes.c_int
    lib.tq_vector_decode.argtypes = []
