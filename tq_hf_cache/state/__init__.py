"""The one owner of a layer's packed state: codes and norms per part, the exact window, sinks, key mean, lengths
(`layer_state`), under two allocation policies: `GrowableState` (`TurboQuantCache`) and `FixedState`
(`TurboQuantStaticCache`)."""

from .growable import GrowableState  # noqa: F401
from .layer_state import LayerState, Quantizers, make_quantizers, part_names  # noqa: F401
from .fixed import FixedState  # noqa: F401
