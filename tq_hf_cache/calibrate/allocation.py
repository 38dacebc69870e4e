"""Per-layer bit allocation: spend a budget of bits per coordinate where the model is most sensitive.

Layers differ by two orders of magnitude in how much quantizing their keys or values moves the model's output
(benchmarks/results/bit_allocation_study_smollm2.json). `measure_sensitivity` measures it: for every layer, kind
and bit width, the mean KL divergence of the next-token distribution from full precision when only that layer's
keys (or values) are quantized at that width, through a chunked prefill as the eval harness runs it.
`allocate_bits` then picks per-layer (key bits, value bits) minimizing the summed KL under the budget (the
per-layer KLs are treated as additive). The result is a plain `TurboQuantConfig` with `layer_bits`, so it saves
with `save_pretrained`, loads with `TurboQuantCache.from_pretrained`, and runs on every path the widths do.

    config = calibrate_bits(model, text, budget=3.25, tokenizer=tok)
    config.save_pretrained("my-model", model_config=model.config)
    cache = TurboQuantCache.from_pretrained("my-model", config=model.config)
"""

from __future__ import annotations

import math

import torch

from .._compat import cache_kwargs
from ..config import TurboQuantConfig, model_facts
from ..quant.packing import packed_bytes

KEY_BITS = (2, 3, 4, 5, 6)
VALUE_BITS = (1, 2, 3, 4)
_PROBE_OTHER_BITS = 8  # the other kind, while one kind is measured: within 0.1 % of fp on both eval models
_NORM_BYTES = {"float16": 2, "float32": 4}


def bits_per_coordinate(layer_bits: dict, head_dim: int, norm_dtype: str = "float16", weights: dict | None = None) -> float:
    """Stored bits per K/V coordinate of a per-layer allocation, norms included (codes packed per vector).

    weights: {layer: share of the tokens it holds} (see `layer_token_weights`); None counts every layer alike."""
    if not layer_bits:
        raise ValueError("layer_bits is empty")
    norm = _NORM_BYTES[norm_dtype]
    w = {i: 1.0 for i in layer_bits} if weights is None else {i: float(weights[int(i)]) for i in layer_bits}
    total = sum(w[i] * (packed_bytes(head_dim, k) + packed_bytes(head_dim, v) + 2 * norm)
                for i, (k, v) in layer_bits.items())
    return total * 8 / (2 * head_dim * sum(w.values()))


def _check_widths(key_bits, value_bits) -> None:
    for name, widths in (("key_bits", key_bits), ("value_bits", value_bits)):
        if not widths or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8 for b in widths):
            raise ValueError(f"{name} must be a non-empty list of widths in 1..8, got {widths!r}")


def min_budget(head_dim: int, key_bits=KEY_BITS, value_bits=VALUE_BITS, norm_dtype: str = "float16") -> float:
    """The fewest stored bits per coordinate an allocation from these widths can reach: every layer at the
    narrowest key and value widths (the same whatever the layers' weights)."""
    _check_widths(key_bits, value_bits)
    return bits_per_coordinate({0: [min(key_bits), min(value_bits)]}, head_dim, norm_dtype)


def check_budget(budget, head_dim: int, key_bits=KEY_BITS, value_bits=VALUE_BITS, norm_dtype: str = "float16",
                 name: str = "budget") -> None:
    """Refuse a budget that is not a positive number, or that is below `min_budget` (no allocation fits it), naming
    `name`, the value and the allowed range; called before anything is measured."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"{name} must be a positive number of bits per coordinate, got {budget!r}")
    least = min_budget(head_dim, key_bits, value_bits, norm_dtype)
    if budget + 1e-9 < least:
        shown = math.ceil(least * 1000 - 1e-6) / 1000
        raise ValueError(f"{name} {budget:g} is below the {shown:g} bits per coordinate of the narrowest widths "
                         f"(key {min(key_bits)}, value {min(value_bits)} bits, {norm_dtype} norms, head dim "
                         f"{head_dim}): {name} must be >= {shown:g}")


def layer_token_weights(model_config, context: int) -> dict[int, float]:
    """{layer: tokens it holds at `context` tokens / context}: 1 for full attention, window / context for a
    sliding-window layer. A budget weighted by these is a budget on the bytes the cache holds at that context."""
    from .._compat import layer_types_and_kwargs

    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive number of tokens, got {context!r}")
    types, kwargs = layer_types_and_kwargs(model_config)
    out = {}
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        window = kw.get("sliding_window") if t in ("sliding_attention", "chunked_attention") else None
        out[i] = min(context, int(window)) / context if window else 1.0
    return out


def min_tokens(chunk: int, base: TurboQuantConfig | None = None) -> int:
    """The fewest tokens whose chunked prefill (`chunk` tokens a step) gives a scored position a quantized token to
    attend to, under `base`'s residual window and sinks.

    A chunk attends to [packed history | residual window | itself]; tokens are quantized only when a chunk pushes
    the window past its capacity (residual_length + min(FLUSH_BLOCK, residual_length)), and then all but the newest
    residual_length; the first sink_tokens are kept exact. So some chunk boundary e < T must exceed both the
    capacity and residual_length + sink_tokens."""
    from ..hf.layer import FLUSH_BLOCK

    base = base or TurboQuantConfig()
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    r = base.residual_length
    need = max(r + min(FLUSH_BLOCK, r), r + base.sink_tokens)
    return (need // chunk + 1) * chunk + 1


def _check_tokens(tokens: int, chunk: int, base: TurboQuantConfig) -> None:
    least = min_tokens(chunk, base)
    if tokens < least:
        raise ValueError(
            f"{tokens} tokens in chunks of {chunk} with residual_length={base.residual_length} and "
            f"sink_tokens={base.sink_tokens} measure nothing: no scored position attends to a quantized token (the "
            f"residual window keeps the newest tokens exact), so every sensitivity would be 0. Pass at least "
            f"{least} tokens, a smaller chunk, or a base config with a smaller residual_length"
        )


@torch.inference_mode()
def _chunk_logprobs(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """log-probs of the positions of chunks 1.. (the ones that attend to the cache) of a chunked prefill."""
    outs = []
    for s in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, s : s + chunk], **cache_kwargs(model, cache), use_cache=True).logits[0].float()
        if s:
            outs.append(torch.log_softmax(logits, -1))
    return torch.cat(outs)


def measure_sensitivity(
    model,
    input_ids: torch.Tensor,
    *,
    chunk: int = 256,
    base: TurboQuantConfig | None = None,
    key_bits=KEY_BITS,
    value_bits=VALUE_BITS,
    progress: bool = True,
) -> dict[int, dict[str, dict[int, float]]]:
    """{layer: {"key": {bits: KL}, "value": {bits: KL}}} measured on input_ids (1, T), T > chunk.

    Each entry is one chunked prefill with only that layer quantized (residual window, sinks, seed and rotation
    from `base`), the measured kind at `bits` and the other at 8 bits. Cost: layers x (len(key_bits) +
    len(value_bits)) prefills of T tokens.
    """
    from tqdm.auto import tqdm

    from ..hf.cache import TurboQuantCache

    base = base or TurboQuantConfig()
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] <= chunk:
        raise ValueError(f"input_ids must be (1, T) with T > chunk={chunk} (positions after the first chunk are "
                         f"scored), got shape {tuple(ids.shape)}")
    layers = model_facts(model.config)["num_hidden_layers"]
    _check_widths(key_bits, value_bits)
    _check_tokens(ids.shape[1], chunk, base)
    ids = ids.to(next(model.parameters()).device)

    def cache(**kw):
        cfg = TurboQuantConfig.from_dict({**base.to_dict(), **kw})
        return TurboQuantCache(cfg, config=model.config)

    ref = _chunk_logprobs(model, ids, cache(skip_layers=list(range(layers)), layer_bits={}), chunk)
    out: dict[int, dict[str, dict[int, float]]] = {}
    jobs = [(i, kind, b) for i in range(layers) for kind, ws in (("key", key_bits), ("value", value_bits)) for b in ws]
    for i, kind, b in tqdm(jobs, desc="sensitivity", disable=not progress):
        bits = [b, _PROBE_OTHER_BITS] if kind == "key" else [_PROBE_OTHER_BITS, b]
        others = [j for j in range(layers) if j != i]
        lp = _chunk_logprobs(model, ids, cache(skip_layers=others, layer_bits={i: bits}), chunk)
        kl = float((ref.exp() * (ref - lp)).sum(-1).mean())
        out.setdefault(i, {"key": {}, "value": {}})[kind][b] = max(kl, 0.0)
    if not any(v > 0 for layer in out.values() for kind in layer.values() for v in kind.values()):
        raise ValueError(
            f"every one of the {len(jobs)} measured sensitivities is 0: quantizing no layer at any width moved the "
            f"output on these {ids.shape[1]} tokens (chunk {chunk}, residual_length {base.residual_length}), so an "
            "allocation would pick the narrowest widths blindly. Measure on more tokens or with a smaller "
            "residual_length"
        )
    return out


def allocate_bits(
    sensitivity: dict,
    budget: float,
    head_dim: int,
    *,
    norm_dtype: str = "float16",
    weights: dict | None = None,
) -> dict[int, list[int]]:
    """Per-layer [key bits, value bits] minimizing the summed KL of `sensitivity` with at most `budget` stored
    bits per coordinate (norms included; see `bits_per_coordinate`, with `weights` when layers hold different
    numbers of tokens).

    A Lagrangian sweep picks each layer's widths for a price per bit (times the layer's weight); the cheapest
    feasible sweep point is then topped up one bit at a time where it lowers the KL most per weighted bit. Raises if even the narrowest widths exceed the budget.
    """
    layers = sorted(int(i) for i in sensitivity)
    sens = {int(i): {k: {int(b): float(x) for b, x in d.items()} for k, d in v.items()} for i, v in sensitivity.items()}
    kw = {i: sorted(sens[i]["key"]) for i in layers}
    vw = {i: sorted(sens[i]["value"]) for i in layers}

    def bpc(choice):
        return bits_per_coordinate(choice, head_dim, norm_dtype, weights)

    narrowest = {i: [kw[i][0], vw[i][0]] for i in layers}
    if bpc(narrowest) > budget + 1e-9:
        raise ValueError(f"budget {budget} bits per coordinate is below the narrowest measured widths "
                         f"({bpc(narrowest):.3f} bits per coordinate with norms)")

    def cost(choice):
        return sum(sens[i]["key"][k] + sens[i]["value"][v] for i, (k, v) in choice.items())

    # the price of a bit in layer i is its share of the stored tokens
    w = {i: 1.0 if weights is None else float(weights[i]) for i in layers}
    best = narrowest
    for step in range(-200, 41):
        lam = 10 ** (step / 20)
        choice = {i: [min(kw[i], key=lambda b: sens[i]["key"][b] + lam * w[i] * b),
                      min(vw[i], key=lambda b: sens[i]["value"][b] + lam * w[i] * b)] for i in layers}
        if bpc(choice) <= budget + 1e-9 and cost(choice) < cost(best):
            best = choice
    best = {i: list(v) for i, v in best.items()}
    while True:  # top up: one more bit where it buys the most KL, while the budget allows
        moves = []
        for i, (k, v) in best.items():
            for which, widths, cur in ((0, kw[i], k), (1, vw[i], v)):
                up = [b for b in widths if b > cur]
                if not up:
                    continue
                trial = {**best, i: [up[0], v] if which == 0 else [k, up[0]]}
                if bpc(trial) <= budget + 1e-9:
                    kind = "key" if which == 0 else "value"
                    gain = sens[i][kind][cur] - sens[i][kind][up[0]]
                    moves.append((gain / (w[i] * (up[0] - cur)), i, trial[i]))
        if not moves:
            break
        gain, i, widths = max(moves)
        if gain <= 0:
            break
        best[i] = widths
    return best


def calibrate_bits(
    model,
    text_or_ids,
    budget: float,
    *,
    tokenizer=None,
    tokens: int = 1024,
    chunk: int = 256,
    base: TurboQuantConfig | None = None,
    key_bits=KEY_BITS,
    value_bits=VALUE_BITS,
    context: int = 4096,
    progress: bool = True,
) -> tuple[TurboQuantConfig, dict]:
    """(a TurboQuantConfig whose `layer_bits` spend `budget` bits per coordinate, the measured sensitivities).

    text_or_ids: a string (needs `tokenizer`) or token ids; the first `tokens` tokens are used. The config keeps
    `base`'s other fields (residual window, sinks, seed, rotation, norm dtype). key_bits / value_bits: the
    widths to choose from (each costs one prefill per layer). context: the budget holds for the bytes the cache
    keeps at this many tokens (sliding-window layers keep fewer; see `layer_token_weights`).
    """
    base = base or TurboQuantConfig()
    layer_token_weights(model.config, context)  # checks context before anything runs
    head_dim = model_facts(model.config)["head_dim"]
    check_budget(budget, head_dim, key_bits, value_bits, base.norm_dtype)
    if base.layer_bits or base.skip_layers or base.skip_first or base.skip_last or base.skip_layer_types:
        raise ValueError("calibrate_bits allocates every layer: pass a base config without layer_bits or skips")
    _check_tokens(tokens, chunk, base)
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("a text needs tokenizer=")
        ids = tokenizer(text_or_ids, return_tensors="pt").input_ids
    else:
        ids = torch.as_tensor(text_or_ids)
        ids = ids[None] if ids.dim() == 1 else ids
    if ids.shape[-1] < tokens:
        raise ValueError(f"the text gives {ids.shape[-1]} tokens; the sensitivities need tokens={tokens}")
    sens = measure_sensitivity(model, ids[:, :tokens], chunk=chunk, base=base, key_bits=key_bits,
                               value_bits=value_bits, progress=progress)
    weights = layer_token_weights(model.config, context)
    layer_bits = allocate_bits(sens, budget, head_dim, norm_dtype=base.norm_dtype, weights=weights)
    config = TurboQuantConfig.from_dict({**base.to_dict(), "layer_bits": {str(i): v for i, v in layer_bits.items()}})
    return config, sens
