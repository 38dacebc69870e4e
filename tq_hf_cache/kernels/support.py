"""What the kernels take and how they are planned: head dims, widths, rows, split plans, whether Triton runs here.
Plain Python (no triton import), so the cache's modules can ask without loading a kernel; the kernel modules import
their limits from here, never from the package."""

from __future__ import annotations

import functools
import os

SUPPORTED_DIMS = (16, 32, 64, 128)  # quantize / dequantize, every width and rotation: tl.dot needs >= 16
# Gemma 3's head dim: Hadamard rotations only (a dense 256 x 256 matrix does not fit the quantize kernel's shared
# memory), quantize up to WIDE_QUANTIZE_BITS (wider widths' search does not compile: ptxas fails on the H100)
WIDE_DIM = 256
WIDE_QUANTIZE_BITS = 4
SUPPORTED_BITS = tuple(range(1, 9))
DECODE_HEAD_DIMS = (64, 128, 256)  # the fused decode-attention kernel (256: group widths only, `decode_supports`)
BYTE_WIDTHS = (2, 4, 8)  # widths whose rows the kernel reads a byte per column (other widths: groups of 8 indices)
DECODE_MAX_ROWS = 128  # its query rows per KV head (query heads per KV head x queries): one kernel tile


MIN_TOKENS_PER_SPLIT = 256  # the fused kernel's packed history per program, at least
PROGRAMS_PER_SM = 4  # num_splits_for's default programs per SM (the launcher passes `decode_plan`'s own)
PLAN_MIN_KEY_ROWS = 131072  # head dim 128: 1 stage from these many packed key rows on (batch x KV heads x tokens)


def decode_plan(head_dim: int, key_bits: int, value_bits: int, split: bool = False,
                key_rows: int | None = None) -> tuple[int, int, int]:
    """(Triton pipeline stages, programs per SM, hand prefetch) of the fused decode kernel, as measured fastest on the
    H100 (benchmarks/results/decode_plan_sweep_h100.json; docs/kernels.md says what each choice bought). key_rows:
    batch x KV heads x packed tokens (None: many). Prefetch 2 issues the next tile's loads before this tile's math;
    0 does not. Two stages pipeline the centroid-table loads through shared memory; one stage makes them plain loads,
    so 6-8 one-warp programs share an SM, which pays for the pair tables, 2-bit tables and split keys at head dims 64
    and 128 once there is enough work, and not for 4- or 8-bit tables at head dim 128 or at head dim 256."""
    widths = (key_bits, value_bits)
    if head_dim > 128:
        return 2, 4, 2
    if head_dim <= 64:
        if 8 in widths and not split:
            return 2, 8, 2
        return 1, 8, 2 if split else 0
    if split:
        return 1, 6, 2
    if 8 in widths:
        return 2, 6, 2
    if 4 in widths or (key_rows is not None and key_rows < PLAN_MIN_KEY_ROWS):
        return 2, 4, 2
    return 1, 6, 0


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def num_splits_for(batch_heads: int, packed_len: int, device, per_sm: int | None = None) -> int:
    """Splits of the packed history for the fused kernel: about `per_sm` (default PROGRAMS_PER_SM) programs per SM,
    at least MIN_TOKENS_PER_SPLIT tokens each."""
    per_sm = PROGRAMS_PER_SM if per_sm is None else per_sm
    want = max(1, (per_sm * sm_count(device) + batch_heads - 1) // batch_heads)
    most = max(1, (packed_len + MIN_TOKENS_PER_SPLIT - 1) // MIN_TOKENS_PER_SPLIT)
    return min(want, most)


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available() -> bool:
    """True when Triton kernels can run here (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if not _triton_ok():
        return False
    if interpreting():
        return True
    import torch

    return torch.cuda.is_available()


def decode_supports(head_dim: int, key_bits: int, value_bits: int, n_queries: int, group: int) -> bool:
    """Whether the fused decode-attention kernel takes n_queries queries of `group` query heads per KV head.

    Head dim 256 only with keys and values at the group widths (1, 3, 5, 6, 7 bits: the default k5v3 among them): a
    byte per column there holds 128-256 registers of codes per tile, which spill, and the workspace path (dequantize
    + SDPA) is faster (docs/performance.md). Whether the kernel is worth it is `decode_pays`."""
    if head_dim not in DECODE_HEAD_DIMS:
        return False
    if head_dim == 256 and (key_bits in BYTE_WIDTHS or value_bits in BYTE_WIDTHS):
        return False
    return key_bits in SUPPORTED_BITS and value_bits in SUPPORTED_BITS and group * n_queries <= DECODE_MAX_ROWS


WIDE_MIN_KEY_ROWS = 65536  # head dim 256: packed key rows (batch x KV heads x tokens) from which the kernel pays


def decode_pays(head_dim: int, key_rows: int, device_type: str = "cuda") -> bool:
    """Whether the fused path is worth it over the workspace path (dequantize + SDPA). On CUDA the Triton kernel has
    a fixed cost per call that a short history at head dim 256 does not repay: always worth it at head dims 64 and
    128, at 256 from WIDE_MIN_KEY_ROWS packed key rows (batch x KV heads x tokens) on. Elsewhere (a CPU's C kernels
    or the torch math) there is no such cost: the fused path is always worth it (docs/performance.md)."""
    return device_type != "cuda" or head_dim <= 128 or key_rows >= WIDE_MIN_KEY_ROWS


MAX_KEY_PARTS = 3  # split keys (`key_split`) the fused kernel takes: up to three parts


def split_supports(sizes, bits) -> bool:
    """Whether the fused decode kernel takes keys split in parts of these channel counts and widths: head dims 64
    and 128, at most MAX_KEY_PARTS parts, each of whole groups of 8 channels packed in whole 4-byte words per row
    (any width)."""
    return 2 <= len(sizes) <= MAX_KEY_PARTS and sum(sizes) in (64, 128) and all(
        n % 8 == 0 and (n * b // 8) % 4 == 0 and b in SUPPORTED_BITS for n, b in zip(sizes, bits))


def supports(dim: int, bits: int, rotation_kind: str = "orthogonal", quantize: bool = True) -> bool:
    """Whether the quantize (or, `quantize=False`, dequantize) kernel takes this head dim, width and rotation: head
    dims 16..128 (powers of two) at 1..8 bits with any rotation, and 256 with a Hadamard rotation (quantize: 1..4
    bits); anything else goes to the torch reference."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        return False
    if dim in SUPPORTED_DIMS:
        return True
    return dim == WIDE_DIM and rotation_kind == "hadamard" and (not quantize or bits <= WIDE_QUANTIZE_BITS)
