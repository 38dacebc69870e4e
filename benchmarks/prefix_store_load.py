"""`PrefixStore` under load and faults, as a server uses it: threads serving chat requests over shared system prompts
and per-user histories, with budgets that push pages through every tier, while disk faults are injected.

Phases (each ends with a check that the disk folder holds at most `disk_bytes` of packs, the files of pages):
- load: --threads threads, each serving --requests requests (match, prefill the rest a turn a chunk, insert), while
  pack writes fail at random (ENOSPC, EIO), and a fault thread deletes, truncates or damages random packs and a
  second process tries to take the folder. Every restored cache is checked against a fresh cache fed the same turn
  chunks (bit for bit: every request computes a prompt in the same chunks, so the contract of docs/prefix_cache.md
  makes them equal); only the documented errors may escape (an insert's OSError, after which nothing of it was kept).
- stuck: with faults off, every prompt is inserted and matched again: none may stay unmatchable.
- restart: a child process serves requests on the folder and is killed (SIGKILL) mid-insert; a new store adopts the
  folder, and its restores are checked as above.
- latency: `match` of a CPU-resident prefix, alone and while other threads insert long prompts whose pages go to
  disk (p50 / p99).
- fill: time to fill a CPU tier and a disk tier of --fill-pages pages each, and the time the folder's file system
  alone takes to make that many files of that size.

Writes prefix_store_load.json and .png into --out.

    python benchmarks/prefix_store_load.py --out benchmarks/results                  # CPU: CPU and disk tiers
    python benchmarks/prefix_store_load.py --device cuda --out DIR                    # a GPU tier in front
"""

from __future__ import annotations

import argparse
import errno
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tq_hf_cache import TurboQuantCache, cache_kwargs  # noqa: E402
from tq_hf_cache import prefix_pages as pp  # noqa: E402
from tq_hf_cache.prefix.disk import SUFFIX, DiskTier  # noqa: E402
from tq_hf_cache.prefix.store import PrefixStore  # noqa: E402

PAGE = 16
RESIDUAL = 16


def tiny_model(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg).eval().to(device), cfg


class Workload:
    """Prompts as turn chunks: a shared system prompt, then a user's turns. Request (u, t) is user u's prompt up to
    turn t; its chunks are the same whoever computes it."""

    def __init__(self, systems: int, users: int, turns: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.systems = [torch.randint(3, 256, (48 + 16 * s,), generator=g) for s in range(systems)]
        self.turns = [[torch.randint(3, 256, (20 + 7 * ((u + t) % 4),), generator=g) for t in range(turns)]
                      for u in range(users)]
        self.users, self.n_turns = users, turns

    def chunks(self, u: int, t: int) -> list[torch.Tensor]:
        return [self.systems[u % len(self.systems)], *self.turns[u][: t + 1]]

    def prompt(self, u: int, t: int) -> torch.Tensor:
        return torch.cat(self.chunks(u, t))[None]


def fresh(model, cfg, chunks, device):
    cache = TurboQuantCache(config=cfg, residual_length=RESIDUAL)
    for c in chunks:
        model(c[None].to(device), **cache_kwargs(model, cache))
    return cache


def state(cache, n: int) -> dict:
    tensors, *_ = pp.capture(cache, torch.zeros(1, n, dtype=torch.long), False, PAGE)
    return {k: v.cpu() for k, v in tensors.items()}


class Server:
    """Serves requests on a store and checks every restore against a fresh cache of the same chunks."""

    def __init__(self, model, cfg, store, work: Workload, device):
        self.model, self.cfg, self.store, self.work, self.device = model, cfg, store, work, device
        self.refs: dict[tuple, dict] = {}
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "hits": 0, "tokens_reused": 0, "wrong": 0, "insert_oserror": 0,
                       "other_errors": 0}
        self.errors: list[str] = []

    def reference(self, chunks) -> dict:
        key = tuple(int(c.numel()) for c in chunks) + tuple(torch.cat(chunks).tolist())
        with self.lock:
            if key in self.refs:
                return self.refs[key]
        with torch.no_grad():
            ref = state(fresh(self.model, self.cfg, chunks, self.device), sum(c.numel() for c in chunks))
        with self.lock:
            self.refs[key] = ref
        return ref

    def serve(self, u: int, t: int) -> None:
        chunks = self.work.chunks(u, t)
        ids = torch.cat(chunks)[None]
        try:
            with torch.no_grad():
                cache, n = self.store.match(torch.cat([ids, torch.tensor([[5]])], 1))
                ends = [sum(c.numel() for c in chunks[: i + 1]) for i in range(len(chunks))]
                wrong = n not in [0, *ends]
                if n and not wrong:
                    k = ends.index(n) + 1
                    got = state(cache, n)
                    want = self.reference(chunks[:k])
                    wrong = set(got) != set(want) or any(not torch.equal(got[x], want[x]) for x in want)
                    rest = chunks[k:]
                else:
                    rest = chunks if not wrong else []
                for c in rest:
                    self.model(c[None].to(self.device), **cache_kwargs(self.model, cache))
            with self.lock:
                self.counts["requests"] += 1
                self.counts["hits"] += n > 0
                self.counts["tokens_reused"] += n
                self.counts["wrong"] += wrong
            if not wrong:
                try:
                    self.store.insert(ids, cache)
                except OSError as e:
                    if "nothing of this insert was stored" not in str(e):
                        raise
                    with self.lock:
                        self.counts["insert_oserror"] += 1
        except Exception as e:  # noqa: BLE001 (counted: none may escape but the documented ones)
            with self.lock:
                self.counts["other_errors"] += 1
                self.errors.append(f"{type(e).__name__}: {e}")


class Faults:
    """Injected faults: failing pack writes (ENOSPC, EIO) at rate `p` (a pack is an insert's pages for the disk), and
    a thread that deletes, truncates or damages a random pack every `every` seconds."""

    def __init__(self, folder: str, p: float, every: float, seed: int = 1):
        self.folder, self.p, self.every = folder, p, every
        self.rng = random.Random(seed)
        self.counts = {"ENOSPC": 0, "EIO": 0, "deleted": 0, "truncated": 0, "damaged": 0, "second_process": 0}
        self._real = DiskTier.write_pack
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._files)

    def __enter__(self):
        real, faults = self._real, self

        def write(tier, *a, **k):
            r = faults.rng.random()
            if r < faults.p / 2:
                faults.counts["ENOSPC"] += 1
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            if r < faults.p:
                faults.counts["EIO"] += 1
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real(tier, *a, **k)

        DiskTier.write_pack = write
        self._thread.start()
        return self

    def __exit__(self, *exc):
        DiskTier.write_pack = self._real
        self._stop.set()
        self._thread.join()

    def _files(self):
        while not self._stop.wait(self.every):
            files = [f for f in os.listdir(self.folder) if f.endswith(SUFFIX)]
            if not files:
                continue
            path = os.path.join(self.folder, self.rng.choice(files))
            kind = self.rng.choice(["deleted", "truncated", "damaged"])
            try:
                if kind == "deleted":
                    os.remove(path)
                elif kind == "truncated":
                    os.truncate(path, os.path.getsize(path) // 2)
                else:
                    with open(path, "r+b") as f:
                        f.seek(max(0, os.path.getsize(path) - 5))
                        f.write(b"\x00\xff\x00\xff\x00")
                self.counts[kind] += 1
            except OSError:
                pass


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(SUFFIX))


def second_process(folder: str) -> str:
    """What a second process gets when it asks for the folder: the documented error, or a failure."""
    code = ("from tq_hf_cache import PrefixStore; from transformers import LlamaConfig; "
            "PrefixStore(config=LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, "
            "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32), page_tokens=16, "
            f"residual_length=16, disk_dir={folder!r}, disk_bytes=1 << 20)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    return "refused" if run.returncode and "in use by another PrefixStore" in run.stderr else run.stderr[-300:]


def make_store(cfg, folder, a, device):
    gpu = dict(device=device, gpu_bytes=a.gpu_bytes) if device == "cuda" else {}
    return PrefixStore(config=cfg, page_tokens=PAGE, residual_length=RESIDUAL, cpu_bytes=a.cpu_bytes,
                       disk_dir=folder, disk_bytes=a.disk_bytes, **gpu)


def phase_load(model, cfg, work, folder, a, device, res):
    store = make_store(cfg, folder, a, device)
    server = Server(model, cfg, store, work, device)
    rng = random.Random(2)
    jobs = [[(rng.randrange(work.users), rng.randrange(work.n_turns)) for _ in range(a.requests)]
            for _ in range(a.threads)]
    with Faults(folder, a.fault_rate, a.fault_every) as faults:
        faults.counts["second_process"] = 1
        res["second_process"] = second_process(folder)
        threads = [threading.Thread(target=lambda js=js: [server.serve(u, t) for u, t in js]) for js in jobs]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        res["load_s"] = round(time.perf_counter() - t0, 2)
    st = store.stats()
    res["load"] = {**server.counts, "faults": faults.counts, "damaged_dropped": st["damaged"],
                   "inserts_rolled_back": st["failed_inserts"], "pages": st["pages"], "bytes": st["bytes"],
                   "disk_file_bytes": folder_bytes(folder), "errors": server.errors[:5]}
    # stuck: faults off, every prompt served as a request is (match, which drops damaged pages it reads, then
    # insert, which stores again what is missing or of the wrong size), then matched again: it must come back whole
    # by the second such request (a page file changed in place is found only when it is read: a prompt whose chain
    # reuses such a file, unread, finds it at its next lookup)
    stuck = {"after_one_request": 0, "after_two_requests": 0}
    for u in range(work.users):
        for t in range(work.n_turns):
            chunks = work.chunks(u, t)
            ids = torch.cat(chunks)[None]
            probe = torch.cat([ids, torch.tensor([[5]])], 1)
            with torch.no_grad():
                c = fresh(model, cfg, chunks, device)
                for rnd in stuck:
                    store.match(probe)
                    store.insert(ids, c)
                    whole = store.match(probe)[1] == ids.shape[1]
                    stuck[rnd] += not whole
                    if whole:
                        break
    res["stuck_prompts"] = stuck
    res["after_load_disk_file_bytes"] = folder_bytes(folder)
    store.close()
    return server


def phase_restart(model, cfg, work, folder, a, device, res):
    """A child serves on the folder and is killed mid-insert; a new store adopts what it left."""
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", folder,
                              "--cpu-bytes", str(a.cpu_bytes), "--disk-bytes", str(a.disk_bytes)],
                             stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline()  # "serving": the child holds the folder and has begun inserting
    time.sleep(a.kill_after)
    child.send_signal(signal.SIGKILL)
    child.wait()
    left = len([f for f in os.listdir(folder) if f.endswith(SUFFIX)])
    store = make_store(cfg, folder, a, "cpu" if device == "cpu" else device)
    adopted = store.stats()["pages"][-1]
    server = Server(model, cfg, store, work, device)
    for u in range(work.users):
        for t in range(work.n_turns):
            server.serve(u, t)
    st = store.stats()
    res["restart"] = {"child_started": line.strip() == "serving", "files_left_by_killed_child": left,
                      "adopted_pages": adopted, **server.counts,
                      "disk_file_bytes": folder_bytes(folder), "errors": server.errors[:5]}
    store.close()


def child_main(folder, cpu_bytes, disk_bytes):
    model, cfg = tiny_model("cpu")
    store = PrefixStore(config=cfg, page_tokens=PAGE, residual_length=RESIDUAL, cpu_bytes=cpu_bytes,
                        disk_dir=folder, disk_bytes=disk_bytes)
    work = Workload(4, 48, 3, seed=7)
    print("serving", flush=True)
    while True:
        for u in range(work.users):
            for t in range(work.n_turns):
                chunks = work.chunks(u, t)
                with torch.no_grad():
                    store.insert(torch.cat(chunks)[None], fresh(model, cfg, chunks, "cpu"))


def phase_latency(model, cfg, work, folder, a, device, res):
    """A CPU-resident prefix looked up alone, then while two threads insert long prompts whose pages go to disk
    (each insert writes: the disk tier holds two of the eight long prompts, so each comes back evicted)."""
    gpu = dict(device=device, gpu_bytes=a.gpu_bytes) if device == "cuda" else {}
    store = PrefixStore(config=cfg, page_tokens=PAGE, residual_length=RESIDUAL, cpu_bytes=256 << 10,
                        disk_dir=folder, disk_bytes=320 << 10, **gpu)
    chunks = work.chunks(0, 0)
    ids = torch.cat(chunks)[None]
    g = torch.Generator().manual_seed(11)
    longs = [torch.randint(3, 256, (1, 512), generator=g) for _ in range(8)]
    with torch.no_grad():
        store.insert(ids, fresh(model, cfg, chunks, device))
        caches = [fresh(model, cfg, [x[0]], device) for x in longs]
    probe = torch.cat([ids, torch.tensor([[5]])], 1)

    def times(n):
        out = []
        for _ in range(n):
            t = time.perf_counter()
            n = store.match(probe)[1]
            if n != ids.shape[1]:
                stop.set()
                raise AssertionError(f"the CPU-resident prefix was not matched whole ({n} of {ids.shape[1]}): "
                                     f"{store.stats()}")
            out.append(time.perf_counter() - t)
            time.sleep(0.001)
        return out

    stop, busy = threading.Event(), threading.Event()
    inserted = {"n": 0}

    def writer(i):
        while not stop.is_set():
            for x, c in zip(longs[i::2], caches[i::2]):
                if busy.wait(0.01):
                    store.insert(x, c)
                    inserted["n"] += 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    times(20)
    alone, loaded = [], []
    for _ in range(a.rounds):  # interleaved: the machine's own noise falls on both alike
        alone += times(a.latency_n // a.rounds)
        busy.set()
        loaded += times(a.latency_n // a.rounds)  # (at once: a prefix not looked up for a while leaves)
        busy.clear()
        with store._insert_lock:  # (the inserts under way end)
            pass
        time.sleep(0.02)
    stop.set()
    for th in threads:
        th.join()

    def q(xs, p):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    st = store.stats()
    res["latency"] = {"alone_p50_ms": round(1e3 * q(alone, .5), 3), "alone_p99_ms": round(1e3 * q(alone, .99), 3),
                      "loaded_p50_ms": round(1e3 * q(loaded, .5), 3),
                      "loaded_p99_ms": round(1e3 * q(loaded, .99), 3), "lookups": a.latency_n,
                      "concurrent_inserts": inserted["n"], "pages_moved": st["moved"], "pages_dropped": st["dropped"]}
    res["latency"]["p99_ratio"] = round(res["latency"]["loaded_p99_ms"] / res["latency"]["alone_p99_ms"], 2)
    store.close()
    return alone, loaded


def bare_files(folder: str, n: int, size: int) -> float:
    """Seconds this folder's file system takes to create n files of `size` bytes (temporary name, rename), with no
    store: the part of the fill that is the disk's own."""
    os.makedirs(folder)
    data = bytes(size)
    t = time.perf_counter()
    for i in range(n):
        tmp = os.path.join(folder, f".{i}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.close(fd)
        os.replace(tmp, os.path.join(folder, f"{i:064x}.safetensors"))
    return time.perf_counter() - t


def phase_fill(cfg, folder, a, res):
    """Fill a CPU tier and a disk tier of --fill-pages pages each (pages of 4 tokens of random K/V)."""
    cache = TurboQuantCache(config=cfg, residual_length=0, sink_tokens=0)
    n = 4 * 32
    for i in range(cfg.num_hidden_layers):
        cache.update(torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32), i)
    one = PrefixStore(config=cfg, page_tokens=4, residual_length=0, sink_tokens=0)
    ids = torch.randint(3, 256, (1, n))
    one.insert(ids, cache)
    page = -(-one.stats()["bytes"][0] // (n // 4))  # (the snapshot holds no bytes: no exact tokens, no sinks)
    store = PrefixStore(config=cfg, page_tokens=4, residual_length=0, sink_tokens=0,
                        cpu_bytes=a.fill_pages * page, disk_dir=folder, disk_bytes=a.fill_pages * (page + 2048))
    g = torch.Generator().manual_seed(3)
    t = time.perf_counter()
    for _ in range(4 * a.fill_pages // (n // 4)):  # (bounded: twice what fills both tiers)
        if min(store.stats()["pages"]) >= a.fill_pages:
            break
        store.insert(torch.randint(3, 256, (1, n), generator=g), cache)
    seconds = time.perf_counter() - t
    pages, on_disk = store.stats()["pages"], folder_bytes(folder)
    store.close()
    files = len([f for f in os.listdir(folder) if f.endswith(SUFFIX)])
    bare = bare_files(os.path.join(folder, "bare"), files, on_disk // max(1, files))
    res["fill"] = {"seconds": round(seconds, 2), "pages": pages, "page_bytes": page, "disk_file_bytes": on_disk,
                   "disk_bytes": store.index.capacity[-1], "files": files, "bare_files_seconds": round(bare, 3)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--requests", type=int, default=24, help="requests per thread")
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--cpu-bytes", type=int, default=48 << 10)
    p.add_argument("--gpu-bytes", type=int, default=32 << 10)
    p.add_argument("--disk-bytes", type=int, default=256 << 10)
    p.add_argument("--fault-rate", type=float, default=0.15, help="of pack writes that fail")
    p.add_argument("--fault-every", type=float, default=0.05)
    p.add_argument("--kill-after", type=float, default=3.0)
    p.add_argument("--latency-n", type=int, default=2000, help="lookups timed, alone and loaded each")
    p.add_argument("--rounds", type=int, default=5, help="alone / loaded blocks of lookups, in turns")
    p.add_argument("--fill-pages", type=int, default=10000)
    p.add_argument("--phases", default="load,restart,latency,fill")
    p.add_argument("--root", default=None, help="where the phases' folders are made (a temporary folder in it)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child_main(a.child, a.cpu_bytes, a.disk_bytes)
        return {}
    torch.set_num_threads(1)
    model, cfg = tiny_model(a.device)
    gc.collect()
    gc.freeze()  # start-up's objects out of the collector's passes, as servers do: a full pass over them stalls all threads
    work = Workload(4, a.users, a.turns)
    res = {"device": a.device if a.device == "cpu" else torch.cuda.get_device_name(), "torch": torch.__version__,
           "threads": a.threads, "requests_per_thread": a.requests, "page_tokens": PAGE,
           "budgets": {"cpu": a.cpu_bytes, "gpu": a.gpu_bytes if a.device == "cuda" else 0, "disk": a.disk_bytes}}
    phases = a.phases.split(",")
    curves = None
    with tempfile.TemporaryDirectory(dir=a.root) as root:
        if "load" in phases:
            phase_load(model, cfg, work, os.path.join(root, "load"), a, a.device, res)
        if "restart" in phases:
            phase_restart(model, cfg, work, os.path.join(root, "restart"), a, a.device, res)
        if "latency" in phases:
            curves = phase_latency(model, cfg, work, os.path.join(root, "latency"), a, a.device, res)
        if "fill" in phases:
            phase_fill(cfg, os.path.join(root, "fill"), a, res)
    gc.unfreeze()
    print(json.dumps(res, indent=1))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        tag = "cpu" if a.device == "cpu" else "gpu"
        with open(os.path.join(a.out, f"prefix_store_load_{tag}.json"), "w") as f:
            json.dump(res, f, indent=1)
        if curves is not None:
            plot(curves, os.path.join(a.out, f"prefix_store_load_{tag}.png"), res["device"])
    return res


def plot(curves, path, device):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for xs, label in zip(curves, ["alone", "under concurrent disk-heavy inserts"]):
        xs = sorted(1e3 * x for x in xs)
        ax.plot(xs, [i / len(xs) for i in range(len(xs))], label=label)
    ax.set_xscale("log")
    ax.set_xlabel("match of a CPU-resident prefix (ms)")
    ax.set_ylabel("fraction of lookups")
    ax.set_title(f"PrefixStore lookup latency ({device})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
