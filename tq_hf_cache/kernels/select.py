"""Which kernel serves a decode attention step: the CUDA kernel (`cuda`), the Triton kernel (`decode_attention`), the
C kernels on a CPU (`cpu`), the torch math (`reference`), or none: the workspace path (dequantize + SDPA).

The one place that asks. A step's shape, widths, split keys and device give a frozen `Choice`, made once per step
and passed on: `ops.decode_attention` dispatches on it, the launchers never choose among themselves. Plain Python
until a kernel is asked for (no triton import), and graph-safe: what the machine and the environment say is a
constant of a torch.compile trace (`_runs`, `knob`), the shape rules are plain comparisons (symbolic sizes become
guards).

One environment knob, TQ_HF_CACHE_DECODE_KERNEL (`ENV`), read at every step:
- "auto" (default): the fastest that serves: on CUDA the CUDA kernel, else the Triton kernel; on a CPU the C
  kernels; else the torch math.
- "cuda", "triton", "cpu": that kernel where it serves the step, else the torch math ("triton" on a CPU needs
  TRITON_INTERPRET=1 set before triton is imported).
- "torch": the torch math.
The former knobs still work, with one warning each: TQ_FUSED_BACKEND (auto / triton / torch: the same names) and
TQ_HF_CACHE_FAST_DECODE=0 ("triton"). Where a faster kernel cannot run on this machine, one warning per reason says why
(once per process).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass

import torch

from . import support

ENV = "TQ_HF_CACHE_DECODE_KERNEL"
KERNELS = ("auto", "cuda", "triton", "cpu", "torch")
# deprecated knobs: name -> {value: what it means now} (a value not listed means "auto")
ALIASES = {"TQ_FUSED_BACKEND": {"auto": "auto", "triton": "triton", "torch": "torch"},
           "TQ_HF_CACHE_FAST_DECODE": {"0": "triton"}}
WORKSPACE = "workspace"  # no fused kernel: the keys and values are dequantized for SDPA

logger = logging.getLogger(__name__)
_WARNED: set = set()  # the reasons already warned about in this process
_CUDA_BROKEN: dict[int, str] = {}  # device index -> why the CUDA kernel cannot run there
_CUDA_READY: set[int] = set()


@dataclass(frozen=True)
class Choice:
    """What serves one step. kernel: "cuda", "triton", "cpu", "torch", or WORKSPACE (no fused attention); chunk: the
    queries a CUDA launch takes where it cannot take them all (0: all); fallback: what serves where the chosen
    launcher declines at launch time (a layout it cannot read, a build that fails); reason: why, for logs and tests."""

    kernel: str
    reason: str = ""
    chunk: int = 0
    fallback: str = "torch"

    @property
    def fused(self) -> bool:
        """Whether the fused attention serves the step (else the workspace path)."""
        return self.kernel != WORKSPACE


def _warn_once(reason: str, message: str, log: bool = False, category: type = RuntimeWarning) -> None:
    """One warning (or, with `log`, one log record: a shape, not the machine) per reason and process."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    if log:
        logger.warning(message)
    else:
        warnings.warn(message, category, stacklevel=4)


def _assume_constant(fn):
    """Under torch.compile the result is a constant of the trace (the environment and NVRTC are not traceable)."""
    return torch.compiler.assume_constant_result(fn)


@_assume_constant
def knob() -> str:
    """The knob's value (`ENV`, or a former knob's meaning, warned once); a bad value is a ValueError naming the
    allowed ones."""
    value = os.environ.get(ENV)
    if value is not None:
        value = value.strip().lower() or "auto"
        if value not in KERNELS:
            raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(KERNELS)}")
        return value
    chosen = "auto"
    for name, meanings in ALIASES.items():
        old = os.environ.get(name)
        if old is None:
            continue
        now = meanings.get(old.strip().lower(), "auto")
        if name == "TQ_FUSED_BACKEND" and old.strip().lower() not in meanings:
            raise ValueError(f"{name}={old!r} (deprecated: use {ENV}): expected one of {', '.join(meanings)}")
        _warn_once(f"alias {name}", f"tq_hf_cache: {name} is deprecated; set {ENV}={now} instead",
                   category=FutureWarning)
        if chosen == "auto":
            chosen = now
    return chosen


def _order(device: torch.device, chosen: str) -> tuple[str, ...]:
    """The kernels the knob allows on this device, fastest first; the torch math last."""
    if chosen == "auto":
        return ("cuda", "triton", "torch") if device.type == "cuda" else ("cpu", "torch")
    return (chosen, "torch") if chosen != "torch" else ("torch",)


@_assume_constant
def _runs(kernel: str, device: torch.device, asked: bool = False) -> bool:
    """Whether `kernel` can run on this device at all (warning once per reason where a GPU kernel cannot run on a
    GPU, the C kernels cannot be built, or the knob `asked` for the Triton kernel on a CPU without the interpreter)."""
    device = torch.device(device)
    if kernel == "torch":
        return True
    if kernel == "cpu":
        return device.type == "cpu" and _cpu_builds()
    if device.type != "cuda" and not (kernel == "triton" and support.interpreting()):
        if asked and kernel == "triton":
            _warn_once("triton: not interpreting", f"tq_hf_cache: {ENV}=triton on a {device.type} needs "
                       "TRITON_INTERPRET=1 (set before triton is imported); the torch math serves")
        return False
    if not support._triton_ok():  # (the CUDA kernel's tables are built by the Triton helpers too)
        if device.type == "cuda":
            _warn_once(f"{kernel}: no triton", f"tq_hf_cache: {kernel} decode kernel unavailable: triton is not "
                                               "importable")
        return False
    return kernel == "triton" or _cuda_ready(device)


def _cuda_ready(device: torch.device) -> bool:
    if not torch.cuda.is_available():
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _CUDA_READY:
        return True
    why = _CUDA_BROKEN.get(idx)
    if why is None:
        from .cuda import jit

        if torch.cuda.get_device_capability(idx) < (8, 0):
            why = "it needs a GPU of compute capability 8.0 or newer"
        else:
            try:
                jit.nvrtc()
            except jit.JitError as e:
                why = str(e)
        if why is None:
            _CUDA_READY.add(idx)
            return True
        _CUDA_BROKEN[idx] = why
    _warn_once(f"cuda: {why}", f"tq_hf_cache: CUDA decode kernel unavailable ({why}); the Triton kernel serves "
                               "instead")
    return False


def cuda_failed(device: torch.device, why: str) -> None:
    """The CUDA kernel failed to build or load on this device: off there for the process (warned once)."""
    idx = device.index if device.index is not None else (torch.cuda.current_device() if torch.cuda.is_available()
                                                         else 0)
    _CUDA_READY.discard(idx)
    _CUDA_BROKEN[idx] = why
    _warn_once(f"cuda: {why}", f"tq_hf_cache: CUDA decode kernel unavailable ({why}); the Triton kernel serves "
                               "instead")


def _cpu_builds() -> bool:
    from . import cpu

    try:
        cpu.library()
    except cpu.JitError as e:
        _warn_once(f"cpu: {e}", f"tq_hf_cache decodes on the CPU with the torch math (slower): {e}")
        return False
    return True


def machine_runs(kernel: str, device) -> bool:
    """Whether `kernel` can run on this device, whatever the knob says (what a layer prepares its tables for)."""
    return _runs(kernel, torch.device(device))


def cuda_serves(device, head_dim: int, key_bits: int, value_bits: int, rows: int, split_keys: bool,
                slots: int) -> bool:
    """Whether the CUDA kernel takes this shape on this device (it also covers shapes the Triton kernel does not,
    such as head dim 256 at 2 and 4 bits). Under torch.compile the rows and slots may be symbolic (they become
    guards); the machine's answer is a constant of the trace."""
    if not _runs("cuda", torch.device(device)):
        return False
    from .cuda import shape_ok

    return shape_ok(head_dim, key_bits, value_bits, rows, split_keys, slots)


def _cuda_shape(head_dim, key_bits, value_bits, rows, split, slots) -> bool:
    from .cuda import shape_ok

    return shape_ok(head_dim, key_bits, value_bits, rows, split is not None, slots)


def _triton_shape(head_dim, key_bits, value_bits, group, n, split) -> bool:
    return support.decode_supports(head_dim, key_bits, value_bits, n, group) and (
        split is None or support.split_supports(*split))


def _cpu_shape(head_dim, split, pair: bool = False) -> bool:
    """The C kernels read scalar codes only (their vector decode looks each code up on its own)."""
    from .cpu import MAX_DIM

    dims = split[0] if split is not None else (head_dim,)
    return not pair and sys.byteorder == "little" and head_dim <= MAX_DIM and all(x % 8 == 0 for x in (head_dim, *dims))


def _chunk(head_dim, key_bits, value_bits, group, n, split, slots, static) -> int:
    """Queries a CUDA launch takes where it cannot take them all (more query rows per KV head than it holds: a few
    tokens of a wide GQA group); 0 where it takes them all or none. Several of its calls, each reading the history,
    beat one Triton call at these rows."""
    from .cuda import max_rows

    per = max_rows(head_dim) // group
    if n == 1 or static or per < 1 or per >= n:
        return 0
    return per if _cuda_shape(head_dim, key_bits, value_bits, group * per, split, slots) else 0


def kernel(device, head_dim: int, key_bits: int, value_bits: int, group: int, n: int, split=None, slots: int = 0,
           static: bool = False, pair: bool = False) -> Choice:
    """The kernel that attends n queries of `group` query heads per KV head over a layer's packed state (never the
    workspace path: a caller that must attend, such as the static cache's op). split: (part sizes, part widths) of
    split keys, or None; slots: the packed slots of the buffer; pair: pair codes (`pair_codebook`) among them."""
    device = torch.device(device)
    chosen = knob()
    triton_ok = _triton_shape(head_dim, key_bits, value_bits, group, n, split)
    for k in _order(device, chosen):
        if k == "cuda":
            if _runs("cuda", device) and _cuda_shape(head_dim, key_bits, value_bits, group * n, split, slots):
                return Choice("cuda", f"{chosen}: the CUDA kernel takes this shape",
                              fallback=_fallback(device, chosen, triton_ok))
            per = _chunk(head_dim, key_bits, value_bits, group, n, split, slots, static) if _runs("cuda", device) \
                else 0
            if per:
                return Choice("cuda", f"{chosen}: the CUDA kernel, {per} queries a launch", per,
                              _fallback(device, chosen, triton_ok))
        elif k == "triton":
            if triton_ok and _runs("triton", device, chosen == "triton"):
                return Choice("triton", f"{chosen}: the Triton kernel takes this shape")
        elif k == "cpu":
            if _cpu_shape(head_dim, split, pair) and _runs("cpu", device):
                return Choice("cpu", f"{chosen}: the C kernels take this shape")
        else:
            return Choice("torch", f"{chosen}: no kernel before the torch math takes this shape on {device.type}")
    raise AssertionError("unreachable: the torch math ends every order")


def _fallback(device, chosen: str, triton_ok: bool) -> str:
    return "triton" if chosen == "auto" and triton_ok and _runs("triton", device) else "torch"


def step(device, head_dim: int, key_bits: int, value_bits: int, group: int, n: int, split=None, slots: int = 0,
         key_rows: int = 0, static: bool = False, fused: bool = True, quiet: bool = False, pair: bool = False) -> Choice:
    """`kernel`, or WORKSPACE where the fused attention does not serve the step or does not pay: fused=False (the
    caller's own setting, `TurboQuantCache(fused_sdpa=False)`), keys split in a way no kernel reads, more query rows
    than a tile, a shape no GPU kernel takes, or head dim 256 over a short history on CUDA (`support.decode_pays`:
    key_rows = batch x KV heads x packed tokens). quiet: no warning for the shapes (SDPA was asked for; or a static
    layer, which asks at every update)."""
    if not fused:
        return Choice(WORKSPACE, "the caller turned the fused attention off (fused_sdpa=False)")
    device = torch.device(device)
    if split is not None and not support.split_supports(*split):
        if not quiet:
            _warn_once(f"split {tuple(split[0])}",
                       f"tq_hf_cache: no fused decode attention for keys split in parts of {list(split[0])} channels (at "
                       f"most {support.MAX_KEY_PARTS} parts of multiples of 8 channels, whole 4-byte words per row); "
                       "those layers use the workspace (dequantize + SDPA) path", log=True)
        return Choice(WORKSPACE, f"keys split in parts of {list(split[0])} channels")
    if group * n > support.DECODE_MAX_ROWS:
        return Choice(WORKSPACE, f"{group * n} query rows per KV head (at most {support.DECODE_MAX_ROWS})")
    chosen = knob()
    if "cuda" in _order(device, chosen) and _runs("cuda", device) \
            and _cuda_shape(head_dim, key_bits, value_bits, group * n, split, slots):
        return kernel(device, head_dim, key_bits, value_bits, group, n, split, slots, static, pair)
    if not support.decode_supports(head_dim, key_bits, value_bits, n, group):
        if not quiet:
            _warn_once(f"shape {head_dim} k{key_bits}v{value_bits}",
                       f"tq_hf_cache: no fused decode attention for head dim {head_dim} with k{key_bits}v{value_bits}; "
                       "those steps use the workspace (dequantize + SDPA) path", log=True)
        return Choice(WORKSPACE, f"no fused kernel for head dim {head_dim} with k{key_bits}v{value_bits}")
    if not support.decode_pays(head_dim, key_rows, device.type):
        return Choice(WORKSPACE, f"head dim {head_dim} over {key_rows} packed key rows: the workspace path is faster")
    return kernel(device, head_dim, key_bits, value_bits, group, n, split, slots, static, pair)


def _facts(query: torch.Tensor, kv) -> dict:
    b, hq, n, d = query.shape
    hkv = kv.k_packed.shape[1]
    split = None if kv.key_split is None else (tuple(kv.key_split.sizes), tuple(kv.key_split.bits))
    return dict(device=query.device, head_dim=d, key_bits=kv.k_codebook.bits, value_bits=kv.v_codebook.bits,
                group=hq // hkv, n=n, split=split, slots=kv.k_packed.shape[2], static=kv.static,
                pair=kv.k_codebook.pair or kv.v_codebook.pair)


def for_step(query: torch.Tensor, kv, fused: bool = True, quiet: bool = False) -> Choice:
    """`step` for a query (B, Hq, n, D) over a `PackedKV` (WORKSPACE where the query heads are no multiple of the
    KV heads)."""
    b, hq = query.shape[:2]
    hkv = kv.k_packed.shape[1]
    if hq % hkv:
        return Choice(WORKSPACE, f"{hq} query heads over {hkv} KV heads")
    packed = kv.capacity if kv.static else int(kv.exact_from)
    return step(**_facts(query, kv), key_rows=b * hkv * packed, fused=fused, quiet=quiet)


def for_packed(query: torch.Tensor, kv) -> Choice:
    """`kernel` for a query over a `PackedKV` (the torch math where the query heads are no multiple of the KV
    heads: it raises the error)."""
    if query.shape[1] % kv.k_packed.shape[1]:
        return Choice("torch", "query heads no multiple of the KV heads")
    return kernel(**_facts(query, kv))


def kernel_serves(query: torch.Tensor, kv) -> bool:
    """Whether a GPU kernel (CUDA or Triton) takes this query over this `PackedKV`."""
    return for_packed(query, kv).kernel in ("cuda", "triton")


def query_chunk(query: torch.Tensor, kv) -> int:
    """The queries a CUDA launch takes for this step where it takes them in chunks (0: all at once, or another
    kernel serves)."""
    c = for_packed(query, kv)
    return c.chunk if c.kernel == "cuda" else 0


def triton_runs(t: torch.Tensor) -> bool:
    """Whether the Triton quantize / dequantize / norm kernels serve a tensor on this device (CUDA only)."""
    return t.is_cuda and support.available()


def quantize_kernel(t: torch.Tensor, rotation, codebook, quantize: bool = True) -> bool:
    """Whether the Triton quantize (or dequantize) kernel takes t under this codebook; a CUDA tensor that cannot warns
    once per reason (the torch reference is much slower). Pair codes, and a quantize that corrects norms, are the torch
    reference's (on the GPU too)."""
    if not t.is_cuda:
        return False
    dim, bits = rotation.dim, codebook.bits
    if codebook.pair or (quantize and codebook.norm_correction):
        return False
    if not support.available():
        reason = "triton is not importable"
    elif not support.supports(dim, bits, rotation.kind, quantize):
        what = "quantize" if quantize else "dequantize"
        reason = (f"the {what} kernel does not take head dim {dim} with {bits} bits and a {rotation.kind} rotation "
                  f"(head dims {support.SUPPORTED_DIMS}; {support.WIDE_DIM} with a hadamard rotation, quantize at "
                  f"1..{support.WIDE_QUANTIZE_BITS} bits)")
    else:
        return True
    _warn_once(f"quantize: {reason}", f"tq_hf_cache falls back to the torch reference on CUDA: {reason}")
    return False
