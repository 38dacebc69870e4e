"""Layers of hybrid models (linear attention beside quantized attention): transformers' `LinearAttentionLayer`
states kept as they are, next to a `TurboQuantLayer` or `TurboQuantSlidingLayer`."""

from __future__ import annotations

from .layer import TurboQuantLayer
from .sliding_layer import TurboQuantSlidingLayer

_HYBRID_CLASSES = None


def hybrid_classes():
    """(full, sliding) layers holding a linear-attention state and quantized attention KV, built on first use
    because transformers 4.x has no LinearAttentionLayer."""
    global _HYBRID_CLASSES
    if _HYBRID_CLASSES is not None:
        return _HYBRID_CLASSES
    from transformers.cache_utils import LinearAttentionLayer

    def make(base, name):
        def __init__(self, number_of_states: int = 1, **kwargs):
            base.__init__(self, **kwargs)
            LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

        def lazy_initialization(self, *args, **kwargs):
            # attention `update` passes (keys, values) positionally; the linear-attention updates pass keywords
            if args:
                base.lazy_initialization(self, *args, **kwargs)
            else:
                LinearAttentionLayer.lazy_initialization(self, **kwargs)

        def both(method):
            def run(self, *args):
                getattr(LinearAttentionLayer, method)(self, *args)
                getattr(base, method)(self, *args)

            run.__name__ = method
            return run

        def crop(self, tokens_to_remove: int):
            LinearAttentionLayer.crop(self, tokens_to_remove)
            base.crop(self, tokens_to_remove)

        def get_seq_length(self) -> int:
            # the attention part's tokens (transformers >= 5.25's LinearAttentionLayer counts its own, which
            # assisted decoding moves on its own schedule)
            return base.get_seq_length(self)

        def activate_past_recording(self, **kwargs):
            # both parts keep what a later crop may need: the linear part its recurrent states (transformers >= 5.25
            # passes how many), a sliding part the tokens that leave its window
            for part in (LinearAttentionLayer, base):
                if hasattr(part, "activate_past_recording"):
                    part.activate_past_recording(self, **kwargs)

        def check_crop(self, tokens_to_remove: int):
            from .crop import check_foreign_crop

            check_foreign_crop(self, tokens_to_remove, LinearAttentionLayer.crop)
            base.check_crop(self, tokens_to_remove)

        attrs = {
            "__init__": __init__,
            "lazy_initialization": lazy_initialization,
            "offload": both("offload"),
            "prefetch": both("prefetch"),
            "reset": both("reset"),
            "reorder_cache": both("reorder_cache"),
            "crop": crop,
            "check_crop": check_crop,
            "get_seq_length": get_seq_length,
            "activate_past_recording": activate_past_recording,
            "is_compileable": False,
            "supports_early_init": True,
            "__doc__": f"{base.__name__} plus the untouched linear-attention (conv/recurrent) states of a hybrid layer.",
        }
        return type(name, (LinearAttentionLayer, base), attrs)

    _HYBRID_CLASSES = (
        make(TurboQuantLayer, "TurboQuantLinearHybridLayer"),
        make(TurboQuantSlidingLayer, "TurboQuantLinearHybridSlidingLayer"),
    )
    return _HYBRID_CLASSES
