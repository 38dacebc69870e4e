"""Prompt prefixes: one prefix saved to a folder and loaded back (`file`), and `PrefixStore` (`store`), the
shared pages of many prompts' caches over memory and disk (`index`, `disk`, `pages`, `catalog`, `checks`).

The names below were the module `tq_hf_cache.prefix` before it became this package; they stay importable from here."""

from .file import (  # noqa: F401
    MAX_COUNT, PREFIX_FORMAT, PREFIX_FORMAT_VERSION, PREFIX_JSON, PREFIX_TENSORS, WEIGHT_SAMPLE, check_index,
    index_digest, load_prefix, quantizer_digest, read_prefix_info, save_prefix, state_digest, token_digest,
    weights_digest,
)
