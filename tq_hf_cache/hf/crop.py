"""All-or-nothing `crop` over a cache's layers: every layer is asked first, and only then is any layer cut.

transformers' caches crop layer by layer, so a refusal from a later layer (a sliding window already past its size,
a static layer given a positive length) leaves the earlier ones cut. Our layers say what they would refuse
(`check_crop`); transformers' own layers are tried on a shallow copy whose containers and counters are private.
"""

from __future__ import annotations

import copy

import torch


def check_foreign_crop(layer, max_length: int, crop=None) -> None:
    """Raise what `crop(layer, max_length)` (default: the layer's own `crop`) would raise, changing nothing: it runs
    on a copy that shares the layer's tensors (a dynamic layer's crop rebinds them) but holds its own lists, dicts
    and one-element tensors (a static layer's length is cut in place)."""
    crop = crop or getattr(type(layer), "crop", None)
    if crop is None:
        raise RuntimeError(f"a {type(layer).__name__} has no crop in this transformers release")
    clone = copy.copy(layer)
    for name, value in vars(layer).items():
        if isinstance(value, (list, dict)):
            setattr(clone, name, copy.copy(value))
        elif isinstance(value, torch.Tensor) and value.numel() <= 1:
            setattr(clone, name, value.clone())
    crop(clone, max_length)


def crop_layers(layers, max_length: int) -> None:
    """Crop every layer by `max_length` (a layer's crop semantics), or raise before any layer changes; the error
    names the layer that refused."""
    for i, layer in enumerate(layers):
        try:
            check = getattr(layer, "check_crop", None)
            if check is not None:
                check(max_length)
            else:
                check_foreign_crop(layer, max_length)
        except (RuntimeError, ValueError) as e:
            raise _named(e, f"crop({max_length}) refused by layer {i} ({type(layer).__name__}); no layer was cropped: "
                         f"{e}") from None
    for layer in layers:
        layer.crop(max_length)


def _named(error: Exception, message: str) -> Exception:
    """`error`'s type with `message` (its plain RuntimeError / ValueError where the type takes other arguments)."""
    try:
        return type(error)(message)
    except TypeError:
        return (ValueError if isinstance(error, ValueError) else RuntimeError)(message)
