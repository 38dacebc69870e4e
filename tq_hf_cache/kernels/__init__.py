"""Triton kernels and their launchers. The cache reaches them only through `tq_hf_cache.ops`.

Triton is imported lazily, so that importing tq_hf_cache works (and falls back to the torch reference)
where triton is missing.
"""

from __future__ import annotations

from .support import (  # noqa: F401  (the package's public names)
    SUPPORTED_DIMS, WIDE_DIM, WIDE_QUANTIZE_BITS, SUPPORTED_BITS, DECODE_HEAD_DIMS, BYTE_WIDTHS,
    DECODE_MAX_ROWS, MIN_TOKENS_PER_SPLIT, PROGRAMS_PER_SM, PLAN_MIN_KEY_ROWS, decode_plan, sm_count,
    num_splits_for, _triton_ok, interpreting, available, decode_supports, WIDE_MIN_KEY_ROWS,
    decode_pays, MAX_KEY_PARTS, split_supports, supports,
)


def _assume_constant(fn):
    """Under torch.compile, the result is a constant of the trace (finding NVRTC through ctypes is not traceable)."""
    import torch

    return torch.compiler.assume_constant_result(fn)


def fast_serves(device, head_dim: int, key_bits: int, value_bits: int, rows: int, split_keys: bool,
                slots: int) -> bool:
    """Whether the explicit-layout kernel (`fast`) takes this shape on this device (it also covers shapes the Triton
    kernel does not, such as head dim 256 at 2 and 4 bits). Under torch.compile the rows and slots may be symbolic
    (they become guards); the machine's answer is a constant of the trace."""
    from . import fast

    return fast.shape_ok(head_dim, key_bits, value_bits, rows, split_keys, slots) and _fast_machine_ok(device)


@_assume_constant
def _fast_machine_ok(device) -> bool:
    import torch

    if torch.device(device).type != "cuda" or not _triton_ok():  # (the Triton kernel finishes what it starts)
        return False
    from . import fast

    return fast.machine_ok(device)


def note_largest_norm(guard, xs):
    """See `kernels.norm_guard.note_largest_norm`."""
    from .norm_guard import note_largest_norm as f

    return f(guard, xs)


def quantize_into(x, rotation, codebook, packed_out, norms_out, **kw):
    """See `kernels.quantize.quantize_into`."""
    from .quantize import quantize_into as f

    return f(x, rotation, codebook, packed_out, norms_out, **kw)


def quantize_kv_into(k, v, rotation, k_codebook, v_codebook, k_packed, k_norms, v_packed, v_norms, **kw):
    """See `kernels.quantize.quantize_kv_into`."""
    from .quantize import quantize_kv_into as f

    return f(k, v, rotation, k_codebook, v_codebook, k_packed, k_norms, v_packed, v_norms, **kw)


def append_kv_into(k, v, rotation, k_codebook, v_codebook, k_packed, k_norms, v_packed, v_norms, ring_k, ring_v,
                   sink_k, sink_v, length, exact_from, n_sinks):
    """See `kernels.quantize.append_kv_into`."""
    from .quantize import append_kv_into as f

    return f(k, v, rotation, k_codebook, v_codebook, k_packed, k_norms, v_packed, v_norms, ring_k, ring_v, sink_k,
             sink_v, length, exact_from, n_sinks)


def append_parts_into(k, v, key_codes, key_quantizers, key_parts, rotation, v_codebook, v_packed, v_norms, ring_k,
                      ring_v, sink_k, sink_v, length, exact_from, n_sinks):
    """See `kernels.quantize.append_parts_into`."""
    from .quantize import append_parts_into as f

    return f(k, v, key_codes, key_quantizers, key_parts, rotation, v_codebook, v_packed, v_norms, ring_k, ring_v,
             sink_k, sink_v, length, exact_from, n_sinks)


def dequantize_into(packed, norms, rotation, codebook, out, **kw):
    """See `kernels.dequantize.dequantize_into`."""
    from .dequantize import dequantize_into as f

    return f(packed, norms, rotation, codebook, out, **kw)
