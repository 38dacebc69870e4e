"""The kernels and their launchers: Triton (quantize, dequantize, decode attention), CUDA (`cuda`: decode attention),
C (`cpu`: decode attention on a CPU). The cache reaches them only through `tq_hf_cache.kernels.ops`; which decode kernel
serves a step is `select`'s answer.

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


def append_kv_into(k, v, rotation, k_codebook, v_codebook, k_packed, k_norms, v_packed, v_norms, window_k, window_v,
                   sink_k, sink_v, length, exact_from, n_sinks):
    """See `kernels.quantize.append_kv_into`."""
    from .quantize import append_kv_into as f

    return f(k, v, rotation, k_codebook, v_codebook, k_packed, k_norms, v_packed, v_norms, window_k, window_v, sink_k,
             sink_v, length, exact_from, n_sinks)


def append_parts_into(k, v, key_codes, key_quantizers, key_parts, rotation, v_codebook, v_packed, v_norms, window_k,
                      window_v, sink_k, sink_v, length, exact_from, n_sinks):
    """See `kernels.quantize.append_parts_into`."""
    from .quantize import append_parts_into as f

    return f(k, v, key_codes, key_quantizers, key_parts, rotation, v_codebook, v_packed, v_norms, window_k, window_v,
             sink_k, sink_v, length, exact_from, n_sinks)


def dequantize_into(packed, norms, rotation, codebook, out, **kw):
    """See `kernels.dequantize.dequantize_into`."""
    from .dequantize import dequantize_into as f

    return f(packed, norms, rotation, codebook, out, **kw)
