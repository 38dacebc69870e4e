"""`NormCheck`: whether one quantize call stored a norm past float16's range, read on the host only when the stored
norms are next used.

float16 norms end at 65504. Reading the largest norm back before storing would make the host wait for the GPU at
every layer of a prefill, which keeps it from queueing the next layer's work (at a 4k prompt that was 15 % of the
time to first token). So the quantize writes exact float32 norms to the side, stores them as float16 (a norm past the
range becomes inf), and the check is settled by the first use of any of the layer's buffers: reading or moving their
norms, copying or pickling them. In a prefill that is the next chunk's step, long after the GPU got there. Where a
norm went past the range the layer's norms widen to float32 and the side copies replace the stored values, so no norm
is ever read clamped.

`TurboQuantStaticCache` keeps the same promise with the helpers below: its layers record the largest norm on the
device (`note_largest`) and read it at their next check (`static_cache`).
"""

from __future__ import annotations

import threading
import warnings
import weakref

import torch

FP16_MAX = 65504.0


def largest_finite(norms: list[torch.Tensor]) -> torch.Tensor:
    """The largest finite value of these norm tensors, a 0-dim float32 tensor on their device (0 when none is)."""
    return torch.stack([torch.where(torch.isfinite(n), n.float(), 0.0).amax() if n.numel() else
                        n.new_zeros((), dtype=torch.float32) for n in norms]).amax()


def row_norms(*xs: torch.Tensor) -> list[torch.Tensor]:
    """The float32 L2 norms of the last-dim vectors of each x: what the quantizer stores for them."""
    return [torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32) for x in xs]


def stored_norms(xs: list[torch.Tensor], quantizers: list[tuple]) -> list[torch.Tensor]:
    """The float32 norms a quantize stores for each x under its (rotation, codebook): the vectors' norms, or, for a
    norm-correcting codebook, those times its gain (`reference.quantize`)."""
    from . import reference

    return [reference.quantize(x, rot, cb, torch.float32)[1] if cb.norm_correction else row_norms(x)[0]
            for x, (rot, cb) in zip(xs, quantizers)]


def note_largest(slot: torch.Tensor, norms: list[torch.Tensor]) -> None:
    """slot (a 0-dim float32 view) = max(slot, the largest finite of these norms), on the device: no host read, so a
    compiled step can record it (non-finite norms come from non-finite input, which stays non-finite anyway)."""
    norms = [n.flatten() for n in norms if n.numel()]
    if norms:
        torch.maximum(slot, torch.cat(norms).nan_to_num_(nan=0.0, posinf=0.0).amax(), out=slot)


def warn_widened(layer_idx, biggest: float, stacklevel: int) -> None:
    warnings.warn(
        f"tq_hf_cache: layer {layer_idx} has a key/value norm of {biggest:.4g}, above float16's range "
        f"({FP16_MAX:.0f}); its norms are stored in float32 from now on (2 more bytes per vector). Set "
        "norm_dtype='float32' to choose this up front.",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
    )


class NormCheck:
    """One quantize call's pending check. `writes`: (buffer, first slot, the float32 norms stored there as float16)
    for every buffer of `state` the call wrote; each buffer holds this check as its `pending` until it is settled.
    The check holds the buffers and the state weakly (no reference cycle keeps a dropped cache alive), and settles
    under a lock: a buffer's `pending` is cleared only once its norms are final, so another thread that reads them
    meanwhile waits here instead.

    Example:
        check = NormCheck(largest_finite([k_norms32, v_norms32]), state, [(state.k_buf, at, k_norms32), (state.v_buf, at, v_norms32)])
        state.k_buf.norms  # settles it: float32 norms from here on if a norm was past 65504
    """

    def __init__(self, biggest: torch.Tensor, state, writes: list[tuple]):
        if biggest.device.type == "cuda":  # read back later: copy to pinned memory now, without waiting
            self._host = torch.empty((), dtype=torch.float32, pin_memory=True)
            self._host.copy_(biggest, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(biggest.device))
        else:
            self._host, self._done = biggest, None
        self._layer = weakref.ref(state)
        self._writes = [(weakref.ref(buf), at, norms) for buf, at, norms in writes]
        self._lock = threading.Lock()
        for buf, _, _ in writes:
            buf.pending = self

    def settle(self) -> None:
        """Wait for the check's value (long ready, as a rule), and widen the state's norms if it calls for that.
        Nothing is marked settled before the norms are final: an error here (out of memory, a warning raised as an
        error) leaves the check pending, to be settled again at the next use."""
        with self._lock:
            if self._writes is None:
                return
            if self._done is not None:
                self._done.synchronize()
            biggest = float(self._host)
            state = self._layer()
            live = [(buf, at, norms) for ref, at, norms in self._writes if (buf := ref()) is not None]
            if biggest > FP16_MAX:
                bufs = {id(b): b for b, _, _ in live}
                if state is not None:
                    bufs.update((id(b), b) for b in state.buffers())
                for buf in bufs.values():
                    buf.widen_norms()
                for buf, at, norms in live:
                    buf.raw_norms()[:, :, at : at + norms.shape[2]].copy_(norms)
                if state is not None:
                    state.norm_dtype = torch.float32
            self._writes = None
            for buf, _, _ in live:
                if buf.pending is self:
                    buf.pending = None
        if biggest > FP16_MAX:
            warn_widened(getattr(state, "layer_idx", "?"), biggest, stacklevel=4)
