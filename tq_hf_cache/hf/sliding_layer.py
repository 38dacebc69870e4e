"""`TurboQuantSlidingLayer`: a sliding-window layer (keeps the newest `sliding_window - 1` tokens), and the crop
rules such a layer follows."""

from __future__ import annotations

import torch

from .._compat import query_length
from .layer import TurboQuantLayer


class SlidingCropError(RuntimeError, ValueError):
    """A crop a sliding-window layer cannot do; transformers raises RuntimeError (5.x) or ValueError (4.x) there."""


class TurboQuantSlidingLayer(TurboQuantLayer):
    """A sliding-window layer: keeps only the newest `sliding_window - 1` tokens, quantized past the residual window."""

    is_sliding = True
    # as transformers' DynamicSlidingWindowLayer: crop is exact while past recording is on (assisted decoding turns it
    # on before its first crop; transformers >= 5.24 checks this flag before assisted decoding)
    is_croppable = True

    def __init__(self, *, sliding_window: int, **kwargs):
        self._record_past = False
        TurboQuantLayer.__init__(self, **kwargs)
        self.sliding_window = int(sliding_window)

    @property
    def record_past(self) -> bool:
        """Whether tokens that leave the window are kept (until the next `crop`); see `activate_past_recording`."""
        return self._record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self._record_past = bool(value)
        if self.kv is not None:
            self.kv.keep = None if self._record_past else self.sliding_window - 1

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor | None = None) -> None:
        TurboQuantLayer.lazy_initialization(self, key_states, value_states)
        self.record_past = self._record_past  # the state drops what leaves the window, unless recording

    def get_mask_sizes(self, query_length_or_cache_position, *args) -> tuple[int, int]:
        q = query_length(query_length_or_cache_position)
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        if self.cumulative_length >= self.sliding_window:
            return self.sliding_window - 1 + q, kv_offset
        return self.cumulative_length + q, kv_offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def get_max_cache_shape(self) -> int:
        return self.sliding_window

    def activate_past_recording(self, **kwargs) -> None:
        """Keep tokens that leave the window until the next `crop` (assisted decoding rolls back rejected ones). Takes
        what transformers passes its layers (>= 5.25: `recurrent_states_to_keep`, which concerns recurrent states,
        of which this layer has none)."""
        self.record_past = True

    def _lazy_ok(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        # a LazyKV holds every stored token; while recording the layer keeps more than the window shows
        return not self.record_past and TurboQuantLayer._lazy_ok(self, key_states, value_states)

    def _visible(self, k: torch.Tensor, v: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """While recording, the layer holds more than the window: attention sees what `get_mask_sizes` says."""
        visible = self.sliding_window - 1 + new_tokens
        if self.record_past and k.shape[2] > visible:
            return k[:, :, -visible:], v[:, :, -visible:]
        return k, v

    def check_crop(self, max_length: int) -> None:
        """Raise what `crop(max_length)` would raise, changing nothing (a cache checks every layer before it crops
        any): past the window only while recording, and only by a count (<= 0) of newest tokens to remove."""
        if not self.is_initialized:
            return
        self.kv.settle()  # what a decode step left beyond the window: no visible change
        if self.get_seq_length() < self.sliding_window:
            return
        if not self.record_past:
            raise SlidingCropError(
                "cannot crop a sliding-window TurboQuant layer once it has seen more tokens than its window "
                f"({self.sliding_window}): the older states are gone; call activate_past_recording() first"
            )
        if max_length > 0:
            raise SlidingCropError(
                "once its window is full, a sliding-window TurboQuant layer is cropped by a negative count of tokens "
                f"to remove, got {max_length}"
            )
        remove, stored = -max_length, self.kv.quantized + self.kv.window.length
        needed = min(self.cumulative_length - remove, self.sliding_window - 1)
        if remove > stored or stored - remove < needed:
            raise SlidingCropError(
                f"cannot remove {remove} tokens from a sliding-window layer that keeps {stored}: the window would "
                f"need {max(needed, 0)} older tokens, dropped before activate_past_recording()"
            )

    def crop(self, max_length: int) -> None:
        """As `DynamicSlidingWindowLayer.crop` (see `check_crop`); it also trims what is kept back to the window."""
        if self.is_initialized:
            self.kv.settle()
        if not self.is_initialized or self.get_seq_length() < self.sliding_window:
            super().crop(max_length)
            return
        self.check_crop(max_length)
        remove, stored = -max_length, self.kv.quantized + self.kv.window.length
        self.kv.truncate(stored - remove)
        self.kv.seen -= remove
        self.kv.trim_front(self.sliding_window - 1)
