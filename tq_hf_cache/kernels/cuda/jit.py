"""CUDA C++ compiled at first use: NVRTC (the library torch's CUDA wheels bring) turns a source and its -D defines
into a cubin, cached on disk; the CUDA driver loads it and launches it on torch's current stream, so that CUDA graphs
capture the launch. ctypes only: no compiler, no build step, no extra package.

Cubins are cached on disk (`kernels.disk_cache`), named by the digest of their source, defines, target and NVRTC
version.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

from .. import disk_cache

_LOCK = threading.Lock()


class JitError(RuntimeError):
    """The CUDA kernel cannot be built or loaded here (the reason is in the message)."""


def _candidates(name: str) -> list[str]:
    """Where an NVIDIA library may be: the nvidia-* wheels beside torch (CUDA 12 and 13 layouts), CUDA_HOME, the
    loader's own search path (the bare name last)."""
    found = []
    for base in sys.path:
        for pattern in (f"nvidia/*/lib/{name}.so*", f"nvidia/cu*/lib/{name}.so*"):
            found += sorted(glob.glob(os.path.join(base, pattern)))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            found += sorted(glob.glob(os.path.join(home, "lib64", f"{name}.so*")))
    found = [f for f in found if "builtins" not in os.path.basename(f) and ".alt." not in os.path.basename(f)]
    return found + [f"{name}.so"]


_NVRTC = None


def nvrtc() -> ctypes.CDLL:
    global _NVRTC
    if _NVRTC is None:
        errors = []
        for path in _candidates("libnvrtc"):
            try:
                lib = ctypes.CDLL(path)
                lib.nvrtcGetErrorString.restype = ctypes.c_char_p
                _NVRTC = lib
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        if _NVRTC is None:
            raise JitError("NVRTC (libnvrtc) was not found; torch's CUDA wheels bring it (nvidia-cuda-nvrtc-*)")
    return _NVRTC


def nvrtc_version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def _check_nvrtc(code: int, what: str) -> None:
    if code:
        raise JitError(f"NVRTC {what} failed: {nvrtc().nvrtcGetErrorString(code).decode()}")


def compile_cubin(source: str, name: str, defines: dict[str, int], arch: int) -> bytes:
    """NVRTC: source -> cubin for sm_<arch> (e.g. 90), with -D defines. Raises JitError with the compiler's log."""
    lib = nvrtc()
    prog = ctypes.c_void_p()
    _check_nvrtc(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None), "create")
    opts = [f"--gpu-architecture=sm_{arch}", "-std=c++17", "--extra-device-vectorization"]
    opts += [f"-D{k}={int(v)}" for k, v in sorted(defines.items())]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    try:
        code = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if code:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise JitError(f"NVRTC could not compile {name} ({defines}):\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        _check_nvrtc(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "get cubin size")
        buf = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib.nvrtcGetCUBIN(prog, buf), "get cubin")
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


CACHE_MAGIC = b"tq_hf_cache cubin 1\n"  # an entry of `disk_cache`


def cubin(source: str, name: str, defines: dict[str, int], arch: int) -> bytes:
    """The cubin of (source, defines, arch), from the disk cache (`disk_cache`) or compiled now and cached."""
    key = disk_cache.key_of(source, sorted(defines.items()), arch, nvrtc_version())
    return disk_cache.cached(f"{name}-sm{arch}-{key}.cubin", key, CACHE_MAGIC,
                             lambda: compile_cubin(source, name, defines, arch))


# ------------------------------------------------------------------------------------------------ the driver

_CUDA = None


def cuda() -> ctypes.CDLL:
    global _CUDA
    if _CUDA is None:
        try:
            _CUDA = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise JitError(f"the CUDA driver (libcuda.so.1) could not be loaded: {e}") from e
    return _CUDA


def _check(code: int, what: str) -> None:
    if code:
        msg = ctypes.c_char_p()
        cuda().cuGetErrorString(code, ctypes.byref(msg))
        raise JitError(f"CUDA driver {what} failed: {code} {msg.value.decode() if msg.value else ''}")


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Kernel:
    """One kernel function of a loaded module, launched with `smem` bytes of dynamic shared memory."""

    def __init__(self, module: ctypes.c_void_p, name: str, smem: int = 0):
        self.func = ctypes.c_void_p()
        _check(cuda().cuModuleGetFunction(ctypes.byref(self.func), module, name.encode()), f"cuModuleGetFunction {name}")
        self.smem = smem
        if smem > 48 * 1024:
            _check(cuda().cuFuncSetAttribute(self.func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                   "cuFuncSetAttribute")

    def launch(self, grid: tuple[int, int, int], block: int, params: ctypes.Structure, stream: int) -> None:
        args = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        _check(cuda().cuLaunchKernel(self.func, grid[0], grid[1], grid[2], block, 1, 1, self.smem,
                                     ctypes.c_void_p(stream), args, None), "cuLaunchKernel")


_MODULES: dict = {}
_KERNELS: dict = {}


def _module(source: str, defines: dict[str, int], device) -> ctypes.c_void_p:
    key = (hash(source), tuple(sorted(defines.items())), device.index)
    mod = _MODULES.get(key)
    if mod is None:
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        image = cubin(source, "tq_hf_cache", defines, major * 10 + minor)
        with torch.cuda.device(device):  # cudaSetDevice: the device's primary context, current here
            ctx = ctypes.c_void_p()
            cuda().cuCtxGetCurrent(ctypes.byref(ctx))
            if not ctx.value:  # torch's runtime made none current here: take the device's primary one
                _check(cuda().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device.index), "primary context")
                _check(cuda().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            mod = ctypes.c_void_p()
            _check(cuda().cuModuleLoadData(ctypes.byref(mod), image), "cuModuleLoadData")
        _MODULES[key] = mod
    return mod


def kernel(source: str, name: str, defines: dict[str, int], device, smem: int = 0) -> Kernel:
    """Kernel `name` of (source, defines) on a torch CUDA device: compiled (or read from the disk cache) and loaded
    once per process and device."""
    import torch

    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (hash(source), tuple(sorted(defines.items())), device.index, name, smem)
    k = _KERNELS.get(key)
    if k is None:
        with _LOCK:
            k = _KERNELS.get(key)
            if k is None:
                k = _KERNELS[key] = Kernel(_module(source, defines, device), name, smem)
    return k
