"""C compiled at first use: the system's C compiler ($CC, else cc) turns `decode.c` into a shared library, cached on
disk (`kernels.disk_cache`) and loaded by ctypes. No build step at install; where no compiler works, `library()` raises
JitError and the callers keep the torch math.

OpenMP: compiled with -fopenmp, the library shares the process's libgomp (torch's, already loaded under that name);
a compiler without OpenMP gets a serial build.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

from .. import disk_cache

MAGIC = b"tq_hf_cache shared library 1\n"
_LOCK = threading.Lock()
_LIBS: dict = {}


class JitError(RuntimeError):
    """The CPU kernel cannot be built or loaded here (the reason is in the message)."""


def source() -> str:
    with open(os.path.join(os.path.dirname(__file__), "decode.c")) as f:
        return f.read()


def compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise JitError(f"no C compiler: {cc!r} is not on PATH (set CC to one)")
    return path


def _version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise JitError(f"the C compiler {cc} does not run: {e}") from None
    return out.stdout.strip()


def arch_flags() -> list[str]:
    """Vector extensions this CPU has, as torch found them (the cache key names them: a cache shared between machines
    never hands one a library it cannot run)."""
    import torch

    if platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        return ["-mavx2", "-mfma", "-mbmi2"]
    return []


def compile_library(src: str, cc: str, flags: list[str]) -> bytes:
    """Compile `src` into a shared library image; raises JitError with the compiler's output."""
    with tempfile.TemporaryDirectory(prefix="tq_hf_cache_cc_") as tmp:
        c_path, so_path = os.path.join(tmp, "decode.c"), os.path.join(tmp, "decode.so")
        with open(c_path, "w") as f:
            f.write(src)
        errors = ""
        for omp in (["-fopenmp"], []):
            cmd = [cc, *flags, *omp, "-shared", "-fPIC", "-std=c11", c_path, "-o", so_path]
            try:
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.SubprocessError) as e:
                raise JitError(f"the C compiler {cc} does not run: {e}") from None
            if out.returncode == 0:
                with open(so_path, "rb") as f:
                    return f.read()
            errors += f"$ {' '.join(cmd)}\n{out.stderr.strip()}\n"
        raise JitError(f"the CPU decode kernel does not compile:\n{errors}")


def _load(image: bytes) -> ctypes.CDLL:
    """dlopen an image from an anonymous file (Linux), else from a private temporary folder: what is loaded is the
    image whose digest was checked, whatever happens to the cache file meanwhile."""
    if hasattr(os, "memfd_create") and sys.platform.startswith("linux"):
        fd = os.memfd_create("tq_hf_cache_decode")
        try:
            os.write(fd, image)
            return ctypes.CDLL(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    with tempfile.TemporaryDirectory(prefix="tq_hf_cache_so_") as tmp:
        path = os.path.join(tmp, "decode.so")
        with open(path, "wb") as f:
            f.write(image)
        return ctypes.CDLL(path)


def library() -> ctypes.CDLL:
    """The CPU decode library (built or read from the disk cache at the first call of the process)."""
    with _LOCK:
        if "decode" not in _LIBS:
            try:
                _LIBS["decode"] = _build()
            except JitError as e:
                _LIBS["decode"] = e  # one attempt a process: a missing compiler is not looked for at every step
        lib = _LIBS["decode"]
    if isinstance(lib, JitError):
        raise lib
    return lib


def _build() -> ctypes.CDLL:
    cc, src, flags = compiler(), source(), ["-O3", *arch_flags()]
    key = disk_cache.key_of(src, flags, _version(cc), platform.machine())
    image = disk_cache.cached(f"cpu_decode-{key}.so", key, MAGIC, lambda: compile_library(src, cc, flags))
    try:
        lib = _load(image)
    except OSError as e:
        raise JitError(f"the CPU decode library does not load: {e}") from None
    _declare(lib)
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.tq_packed_scores.argtypes = [p, i64, i64, p, i64, p, i64, i64, p, i64, p, i64, i64, i32, i32, i32, i32, i32,
                                     i32, i32, i32]
    lib.tq_packed_values.argtypes = [p, i64, i64, p, i64, p, i64, i64, p, i64, p, i32, i32, i32, i32, i32, i32, i32]
    lib.tq_packed_scores.restype = lib.tq_packed_values.restype = ctypes.c_int
