"""The transformers adapters: `TurboQuantCache` and `TurboQuantStaticCache`, their layers over the layer
states (`tq_hf_cache.state`), the "turboquant" attention, crop and tensor-parallel helpers."""
