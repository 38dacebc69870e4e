"""PrefixStore restore time per tier for one prefix of the Llama-3.1-8B shape (32 layers, 8 KV heads, head dim 128,
k5v3, random K/V filled through the cache's own update), on a GPU: a store with a GPU tier, one with CPU memory only
(pinned), one with everything on disk (its files just written: in the page cache); insert once, then `match` five
times: the first (it holds one-time work: a disk store's pinned staging buffer is made there) and the median of
the other four. Then what restoring saves: the same number of tokens prefilled into a TurboQuantCache by the
model itself (random bf16 weights, 8192-token chunks, attention "turboquant", median
of two after a warm-up). Writes
$OUT/prefix_store_restore_h100.json.

    python benchmarks/studies/prefix_store_restore.py [tokens]
"""
import hashlib, time, json, os, sys, tempfile, statistics, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from tq_hf_cache import TurboQuantCache, cache_kwargs
from tq_hf_cache.bench import llama_8b_config
from tq_hf_cache.prefix_store import PrefixStore
from tq_hf_cache import prefix_pages
cfg = llama_8b_config(32, max_position_embeddings=131072)
T = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
g = torch.Generator("cuda").manual_seed(0)
cache = TurboQuantCache(config=cfg)
for i in range(32):
    k = torch.randn(1, 8, T, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cache.update(k, torch.randn_like(k), i)
ids = torch.randint(0, cfg.vocab_size, (T,))
res = {"tokens": T, "device": torch.cuda.get_device_name(0)}
d = tempfile.mkdtemp()
stores = {"gpu": dict(device="cuda", gpu_bytes=8 << 30, cpu_bytes=1 << 30),
          "cpu": dict(device="cuda", cpu_bytes=8 << 30),
          "disk": dict(device="cuda", cpu_bytes=0, disk_dir=d, disk_bytes=64 << 30)}
q = torch.cat([ids, torch.tensor([5])])
for name, kw in stores.items():
    store = PrefixStore(config=cfg, page_tokens=256, **kw)
    t = time.perf_counter(); store.insert(ids, cache); torch.cuda.synchronize(); ins = time.perf_counter() - t
    times = []
    for _ in range(5):
        torch.cuda.synchronize(); t = time.perf_counter()
        c, n = store.match(q); torch.cuda.synchronize(); times.append(time.perf_counter() - t)
        assert n == T
    if name == "disk":  # where a disk restore goes: the page files read, read and hashed, loaded (read, hashed, parsed)
        from concurrent.futures import ThreadPoolExecutor
        files = [v for v in store._held.values() if isinstance(v, str)]
        phases = {}
        t = time.perf_counter()
        for f in files:
            with open(f, "rb") as fh:
                fh.read()
        phases["read_one_thread_s"] = time.perf_counter() - t
        t = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda f: hashlib.sha256(open(f, "rb").read()).digest(), files))
        phases["read_and_hash_16_threads_s"] = time.perf_counter() - t
        keys = list(store._held)  # as match: read, checked, parsed into the staging buffer, copied to the GPU once
        t = time.perf_counter()
        loaded = store._reader.read(keys)
        phases["load_staged_s"] = time.perf_counter() - t
        t = time.perf_counter()
        chain = [loaded[k] for k in keys if "tensors" not in loaded[k]] + [loaded[k] for k in keys
                                                                          if "tensors" in loaded[k]]
        prefix_pages.restore(store._new_cache(), [chain], store.config, store.device, False)
        torch.cuda.synchronize()
        phases["restore_from_loaded_s"] = time.perf_counter() - t
        res["disk_phases"] = {k: round(v, 3) for k, v in phases.items()}
        print("disk phases", res["disk_phases"], flush=True)
        del loaded, chain
    st = store.stats()
    res[name] = {"insert_s": round(ins, 3), "restore_s": [round(x, 3) for x in times], "first_s": round(times[0], 3),
                 "restore_median_s": round(statistics.median(times[1:]), 3), "bytes": st["bytes"],
                 "pages": st["pages"]}
    print(name, res[name], flush=True)
    del store, c
res["packed_bytes"] = cache.nbytes()
del cache
from transformers import LlamaForCausalLM  # noqa: E402
torch.set_default_dtype(torch.bfloat16)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).eval()
torch.set_default_dtype(torch.float32)
model.set_attn_implementation("turboquant")  # the cache's own attention: the fastest prefill it has


def prefill(n):
    c = TurboQuantCache(config=cfg)
    x = torch.randint(0, cfg.vocab_size, (1, n), device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        for i in range(0, n, 8192):
            model(x[:, i:i + 8192], **cache_kwargs(model, c), logits_to_keep=1)
    torch.cuda.synchronize()
    return time.perf_counter() - t


prefill(T)  # the first call at this length holds first-use work (kernels for its shapes): not a recompute
rec = statistics.median([prefill(T) for _ in range(2)])
res["recompute_s"] = round(rec, 3)
res["restore_over_recompute"] = {k: round(res[k]["restore_median_s"] / rec, 3) for k in stores}
print("recompute", res["recompute_s"], res["restore_over_recompute"], flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "prefix_store_restore_h100.json"), "w"), indent=1)
