"""What a code means: rotations, codebooks, bit packing, RoPE, key splits, the norms' range, the layout a
layer's state is read in (`packed_kv`), and `reference`, the torch oracle of every op."""
