"""The package's house: its rooms, floors and arrows, drawn, and the rooms a decode step or a prefix match enters.

    python scripts/house.py --root REPO_TREE --out DIR [--label before] [--commit HASH] [--no-walks]

REPO_TREE is a tree holding `tq_hf_cache/` (the repository, or an old commit extracted with
`git archive HASH | tar -x -C DIR`), so that two versions of the house can be drawn alike.

Definitions:
- room: a module of the package `tq_hf_cache`, a .py file at any depth; a package's `__init__.py` is a room named
  after the package.
- arrow: module A imports module B, both rooms, read statically from A's AST: `import` and `from ... import`,
  absolute or relative, anywhere in the file. `from .x import name` points at room x; `from . import x` at room x
  when x is a module, else at the package's `__init__`. Several imports of B by A are one arrow. An arrow is lazy
  when every import behind it sits inside a function (it runs at the first call, not at import). Imports under
  `if TYPE_CHECKING:` never run: they are listed apart as typing arrows and count nowhere else. Importing
  `a.b.c` also runs `a` and `a.b`'s `__init__`; that implicit step is not an arrow.
- floor: the longest-path depth over the arrows (lazy ones included): a room importing no room is floor 0, any other
  is 1 + the highest floor it imports. Rooms in an import cycle (reported) share one floor.
- walk: on CPU, in a subprocess that imports the package from REPO_TREE alone, a tiny random Llama (2 layers, head
  dim 64: one the fused decode attention takes, so that a step reaches a kernel, on a CPU the C one) runs (a) one
  decode step of `TurboQuantCache` through `model(...)` with attn_implementation "turboquant", (b) one eager decode
  step of `TurboQuantStaticCache` with "turboquant", (c) one `PrefixStore.match` (default config, a 300-token
  prompt past the 128-token residual window, 64-token pages). Prefill, store building and one untraced warm run of
  the same step (so that lazy imports, first-step allocations and JIT builds stay outside) come first; then
  `sys.setprofile` records the Python calls of that one step whose code lives in the package: the rooms entered,
  in the order first entered. On a GPU a step would enter the CUDA or Triton launchers' rooms instead of the C's.

Writes DIR/house_LABEL.json and DIR/house_LABEL.png (rooms as boxes by floor, coloured by sub-package; arrows from
importer down to imported, lazy ones dashed; the letters a b c under a room: the walks that enter it), and prints
the rooms per floor.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import warnings

PACKAGE = "tq_hf_cache"


# ---- the rooms and arrows, from the source alone ----

def rooms(root: str, package: str = PACKAGE) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file under root/package."""
    found = {}
    for dirpath, dirnames, files in os.walk(os.path.join(root, package)):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def _imports(tree: ast.AST):
    """(node, kind) for every import statement: kind "eager", "lazy" (inside a function) or "typing" (under
    `if TYPE_CHECKING:`)."""
    out = []

    def visit(node, kind):
        for child in ast.iter_child_nodes(node):
            here = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and kind == "eager":
                here = "lazy"
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for inner in child.body:
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        out.append((inner, "typing"))
                    visit(inner, "typing")
                for inner in child.orelse:
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        out.append((inner, here))
                    visit(inner, here)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((child, here))
            visit(child, here)

    visit(tree, "eager")
    return out


def arrows(mods: dict[str, str], package: str = PACKAGE) -> dict[tuple[str, str], str]:
    """(importer, imported) -> "eager" | "lazy" | "typing": the strongest kind among the imports behind it."""
    rank = {"eager": 0, "lazy": 1, "typing": 2}

    def known(name: str) -> str | None:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else None

    found: dict[tuple[str, str], str] = {}
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        here = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
        for node, kind in _imports(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                names = [f"{base}.{a.name}" for a in node.names if a.name != "*"] or [base]
            else:
                names = [a.name for a in node.names]
            for name in names:
                if not (name == package or name.startswith(package + ".")):
                    continue
                target = known(name)
                if target is None or target == mod:
                    continue
                key = (mod, target)
                if key not in found or rank[kind] < rank[found[key]]:
                    found[key] = kind
    return found


def strongly_connected(nodes, edges) -> list[list[str]]:
    """Tarjan's components, each a sorted list; a lone node without a self-arrow is its own component."""
    succ = {n: sorted({b for a, b in edges if a == n}) for n in nodes}
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(nodes) + 100))
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return comps


def floors(nodes, edges) -> tuple[dict[str, int], list[list[str]]]:
    """(room -> floor, cycles): the longest-path depth over the components' graph; cycles are the components of
    more than one room."""
    comps = strongly_connected(nodes, edges)
    comp_of = {n: i for i, c in enumerate(comps) for n in c}
    below = {i: set() for i in range(len(comps))}
    for a, b in edges:
        if comp_of[a] != comp_of[b]:
            below[comp_of[a]].add(comp_of[b])
    level: dict[int, int] = {}
    for i in range(len(comps)):  # Tarjan emits a component after every component it reaches
        level[i] = 1 + max((level[j] for j in below[i]), default=-1)
    return {n: level[comp_of[n]] for n in nodes}, [c for c in comps if len(c) > 1]


def classes(mods: dict[str, str]) -> list[dict]:
    """Every class (nested ones too) with its lines, decorators included, longest first."""
    out = []
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                out.append({"name": node.name, "module": mod, "lines": node.end_lineno - start + 1})
    return sorted(out, key=lambda c: (-c["lines"], c["module"], c["name"]))


def files(root: str) -> tuple[list[str], str]:
    """(the tree's files, relative, how they were counted): `git ls-files` when root is a repository's top, else the
    files on disk (an extracted `git archive` holds exactly the commit's files) minus caches and build outputs."""
    try:
        top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                             check=True).stdout.strip()
        if os.path.realpath(top) == os.path.realpath(root):
            listed = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, text=True,
                                    check=True).stdout
            return [f for f in listed.split("\0") if f], "git ls-files"
    except (OSError, subprocess.CalledProcessError):
        pass
    skip = {"__pycache__", ".git", ".venv", "build", "dist", ".pytest_cache", "site", ".before"}
    out = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
        out += [os.path.relpath(os.path.join(dirpath, n), root) for n in names]
    return sorted(out), "files on disk"


def house(root: str, package: str = PACKAGE) -> dict:
    """Everything the source alone tells: rooms, arrows, floors, cycles, classes, module sizes, files."""
    mods = rooms(root, package)
    found = arrows(mods, package)
    runtime = sorted(k for k, v in found.items() if v != "typing")
    eager = sorted(k for k, v in found.items() if v == "eager")
    floor_of, cycles = floors(list(mods), runtime)
    eager_floor_of, eager_cycles = floors(list(mods), eager)
    per_floor = [sorted(m for m in mods if floor_of[m] == f) for f in range(max(floor_of.values()) + 1)]
    lines = {}
    for m, path in mods.items():
        with open(path, encoding="utf-8") as f:
            lines[m] = len(f.read().splitlines())
    largest = max(lines, key=lambda m: (lines[m], m))
    cls = classes(mods)
    tracked, counted_by = files(root)
    return {
        "rooms": len(mods),
        "floors": len(per_floor),
        "floors_eager_arrows_only": max(eager_floor_of.values()) + 1,
        "arrows": len(runtime),
        "lazy_arrows": sum(found[k] == "lazy" for k in runtime),
        "typing_arrows": sorted([a, b] for (a, b), v in found.items() if v == "typing"),
        "cycles": cycles,
        "cycles_eager_arrows_only": eager_cycles,
        "longest_class": cls[0] if cls else None,
        "classes_over_300_lines": [c for c in cls if c["lines"] > 300],
        "classes_top5": cls[:5],
        "largest_module": {"module": largest, "lines": lines[largest]},
        "package_lines": sum(lines.values()),
        "files_tracked": len(tracked),
        "files_under_benchmarks": sum(f.startswith("benchmarks/") for f in tracked),
        "files_counted_by": counted_by,
        "per_floor": per_floor,
        "packages": sorted(m for m, path in mods.items() if path.endswith("__init__.py")),
        "module_lines": lines,
        "arrow_list": [[a, b, found[(a, b)]] for a, b in runtime],
    }


# ---- the walks, in a subprocess of the tree's own package ----

def _walk_worker(out_path: str) -> None:
    """Runs inside `python house.py --walk-worker OUT` with PYTHONPATH=the tree; writes the walks as JSON."""
    import torch
    import transformers

    import tq_hf_cache
    from tq_hf_cache import PrefixStore, TurboQuantCache, TurboQuantStaticCache, cache_kwargs

    torch.set_num_threads(1)
    pkg_dir = os.path.dirname(os.path.abspath(tq_hf_cache.__file__))
    want = os.environ.get("HOUSE_ROOT")
    if want and os.path.realpath(os.path.dirname(pkg_dir)) != os.path.realpath(want):
        raise SystemExit(f"the walks imported {pkg_dir}, not the tree {want}")
    prefix = pkg_dir + os.sep

    def module_of(filename: str) -> str:
        rel = os.path.relpath(filename, os.path.dirname(pkg_dir))[:-3].replace(os.sep, ".")
        return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel

    def traced(fn) -> dict:
        order, first, calls, funcs = [], {}, {}, set()

        def profile(frame, event, arg):
            if event != "call":
                return
            code = frame.f_code
            if not code.co_filename.startswith(prefix):
                return
            mod = module_of(code.co_filename)
            if mod not in calls:
                order.append(mod)
                first[mod] = getattr(code, "co_qualname", code.co_name)
                calls[mod] = 0
            calls[mod] += 1
            funcs.add((mod, code.co_firstlineno, code.co_name))

        import threading

        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
        return {"rooms": len(order), "modules": order, "entered_by": [first[m] for m in order],
                "calls": calls, "functions": len(funcs)}

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompt = 300  # past the default 128-token residual window: the history is quantized
    ids = torch.randint(3, 128, (1, prompt + 4), generator=torch.Generator().manual_seed(0))
    walks, setup = {}, {"prompt_tokens": prompt, "model": "LlamaForCausalLM 2 layers, head dim 64, random",
                        "torch": torch.__version__, "transformers": transformers.__version__}

    def dynamic_step():
        model.set_attn_implementation("turboquant")
        cache = TurboQuantCache(config=cfg)
        model(ids[:, :prompt], **cache_kwargs(model, cache))
        model(ids[:, prompt: prompt + 1], **cache_kwargs(model, cache))  # the warm step
        return lambda: model(ids[:, prompt + 1: prompt + 2], **cache_kwargs(model, cache))

    def static_step():
        model.set_attn_implementation("turboquant")
        cache = TurboQuantStaticCache(cfg, max_cache_len=prompt + 8)
        model(ids[:, :prompt], **cache_kwargs(model, cache))

        def step(t):
            pos = torch.tensor([t])
            return model(ids[:, t: t + 1], **cache_kwargs(model, cache), cache_position=pos,
                         position_ids=pos.expand(1, 1))

        step(prompt)
        return lambda: step(prompt + 1)

    def prefix_match():
        model.set_attn_implementation("turboquant")
        store = PrefixStore(config=cfg, page_tokens=64)
        cache = TurboQuantCache(config=cfg)
        model(ids[:, :prompt], **cache_kwargs(model, cache))
        store.insert(ids[:, :prompt], cache)
        got, n = store.match(ids)
        if n != prompt:
            raise RuntimeError(f"the warm match restored {n} tokens, not {prompt}")
        return lambda: store.match(ids)

    for name, make in (("dynamic_decode_step", dynamic_step), ("static_decode_step", static_step),
                       ("prefix_store_match", prefix_match)):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            try:
                with torch.no_grad():
                    run = make()
                    walks[name] = traced(run)
            except Exception as e:  # a tree whose API differs: the other walks still run
                walks[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        walks[name]["warnings"] = sorted({str(w.message)[:300] for w in said})
    with open(out_path, "w") as f:
        json.dump({"setup": setup, "walks": walks}, f, indent=1)


def walk(root: str, timeout: float = 600) -> dict:
    """The walks of root's package, in a subprocess whose only tq_hf_cache is root's."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "walks.json")
        env = {**os.environ, "PYTHONPATH": os.path.abspath(root), "HOUSE_ROOT": os.path.abspath(root),
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--walk-worker", out], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"the walks failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


# ---- the drawing and the text form ----

def _group(mod: str, packages=()) -> str:
    """The (sub-)package a room belongs to: a package's `__init__` to that package, a module to its parent."""
    return mod if mod in packages else mod.rsplit(".", 1)[0]


def _short(mod: str, packages=()) -> str:
    """A room's name inside the package, a path: `kernels/select`, `kernels/__init__`."""
    rest = mod[len(PACKAGE) + 1:].replace(".", "/") if mod.startswith(PACKAGE + ".") else ""
    if mod in packages:
        return f"{rest}/__init__" if rest else "__init__"
    return rest or mod


def text_form(h: dict) -> str:
    lines = []
    for f in range(len(h["per_floor"]) - 1, -1, -1):
        names = h["per_floor"][f]
        lines.append(f"floor {f} ({len(names)}): " + ", ".join(_short(m, h["packages"]) for m in names))
    return "\n".join(lines)


def _order_floors(h: dict) -> list[list[str]]:
    """Rooms of each floor left to right: grouped by sub-package, inside a group by the mean place of what they
    import and what imports them (a few sweeps), so that arrows cross less."""
    per = [list(f) for f in h["per_floor"]]
    groups = sorted({_group(m, h["packages"]) for f in per for m in f})
    nbr: dict[str, list[str]] = {m: [] for f in per for m in f}
    for a, b, _ in h["arrow_list"]:
        nbr[a].append(b)
        nbr[b].append(a)
    x = {m: i / max(len(f) - 1, 1) for f in per for i, m in enumerate(f)}
    for _ in range(6):
        for f in per:
            bary = {m: sum(x[n] for n in nbr[m]) / len(nbr[m]) if nbr[m] else x[m] for m in f}
            f.sort(key=lambda m: (groups.index(_group(m, h["packages"])), bary[m], m))
            for i, m in enumerate(f):
                x[m] = i / max(len(f) - 1, 1)
    return per


def draw(h: dict, path: str, title: str, walks: dict | None = None) -> None:
    """Rooms as boxes by floor (coordinates in inches), arrows from the importer down to what it imports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

    per = _order_floors(h)
    pk = h["packages"]
    widest = max(len(f) for f in per)
    box_w, box_h, gap_x, gap_y, left, top = 1.35, 0.42, 0.15, 0.75, 1.0, 1.3
    width = left + widest * (box_w + gap_x) + 0.2
    height = (len(per) - 1) * gap_y + box_h + top + 0.3
    groups = sorted({_group(m, pk) for f in per for m in f})
    cmap = plt.get_cmap("tab10")
    colour = {g: cmap(i % 10) for i, g in enumerate(groups)}
    pos = {}
    for fl, mods in enumerate(per):
        x0 = left + (widest - len(mods)) * (box_w + gap_x) / 2
        for i, m in enumerate(mods):
            pos[m] = (x0 + i * (box_w + gap_x) + box_w / 2, 0.3 + box_h / 2 + fl * gap_y)
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    for a, b, kind in h["arrow_list"]:
        (xa, ya), (xb, yb) = pos[a], pos[b]
        ax.add_patch(FancyArrowPatch((xa, ya - box_h / 2), (xb, yb + box_h / 2), arrowstyle="-|>", mutation_scale=6,
                                     lw=0.5, color=colour[_group(a, pk)], alpha=0.4,
                                     linestyle=(0, (3, 2)) if kind == "lazy" else "-", zorder=1))
    letters: dict[str, list[str]] = {}
    for key, w in (walks or {}).items():
        for m in w.get("modules", []):
            letters.setdefault(m, []).append(key)
    for m, (x, y) in pos.items():
        ax.add_patch(FancyBboxPatch((x - box_w / 2, y - box_h / 2), box_w, box_h, boxstyle="round,pad=0.01",
                                    fc=colour[_group(m, pk)], ec="black", lw=0.5, zorder=2))
        ax.text(x, y + 0.07, _short(m, pk), ha="center", va="center", fontsize=6.5, zorder=3, color="white",
                fontweight="bold")
        tag = f"{h['module_lines'][m]} lines" + (f"   {' '.join(letters[m])}" if m in letters else "")
        ax.text(x, y - 0.11, tag, ha="center", va="center", fontsize=5.5, zorder=3, color="white")
    for fl in range(len(per)):
        ax.text(left - 0.15, 0.3 + box_h / 2 + fl * gap_y, f"floor {fl}", ha="right", va="center", fontsize=7)
    ax.legend(handles=[Patch(color=colour[g], label=g) for g in groups], loc="upper right", fontsize=7,
              frameon=False, ncol=min(len(groups), 3), bbox_to_anchor=(1.0, 1.0 - 0.95 / height))
    ax.text(0.15, height - 0.12, title, ha="left", va="top", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    from PIL import Image  # (matplotlib's own dependency) 64 colours: a third of the bytes, the same picture

    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="a tree holding tq_hf_cache/ (default: this repository)")
    p.add_argument("--out", help="folder for house_LABEL.json and .png")
    p.add_argument("--label", default="now")
    p.add_argument("--commit", help="the commit the tree is (default: git rev-parse HEAD in --root, if a repository)")
    p.add_argument("--no-walks", action="store_true", help="the source's figures only")
    p.add_argument("--walk-worker", metavar="OUT", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.walk_worker:
        _walk_worker(a.walk_worker)
        return
    if not a.out:
        p.error("--out is required")
    if not os.path.isfile(os.path.join(a.root, PACKAGE, "__init__.py")):
        p.error(f"{a.root} holds no {PACKAGE}/__init__.py")
    h = house(a.root)
    commit = a.commit
    if commit is None and h["files_counted_by"] == "git ls-files":
        commit = subprocess.run(["git", "-C", a.root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or None
    res = {"label": a.label, "commit": commit, **h}
    if not a.no_walks:
        w = walk(a.root)
        res["walk_setup"] = w["setup"]
        res["walks"] = w["walks"]
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"house_{a.label}")
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    letters = {"a": "dynamic_decode_step", "b": "static_decode_step", "c": "prefix_store_match"}
    walks = {k: res["walks"][v] for k, v in letters.items() if v in res.get("walks", {})}
    walked = "; ".join(f"{k}) {v.replace('_', ' ')}: {res['walks'][v].get('rooms', 'failed')} rooms"
                       for k, v in letters.items() if v in res.get("walks", {}))
    lc = h["longest_class"]
    title = (f"{PACKAGE} {a.label}{f' ({commit})' if commit else ''}: {h['rooms']} rooms, {h['floors']} floors, "
             f"{h['arrows']} arrows ({h['lazy_arrows']} lazy, dashed); longest class {lc['name']} "
             f"({lc['lines']} lines)" + (f"\nwalks: {walked}" if walked else "") +
             "\nunder each room: its lines, and the walks that enter it")
    draw(h, base + ".png", title, walks)
    print(text_form(h))
    print(f"rooms {h['rooms']}, floors {h['floors']}, arrows {h['arrows']} ({h['lazy_arrows']} lazy), "
          f"typing arrows {len(h['typing_arrows'])}, cycles {h['cycles'] or 'none'}")
    print(f"longest class {lc['name']} in {lc['module']}: {lc['lines']} lines; largest module "
          f"{h['largest_module']['module']}: {h['largest_module']['lines']} lines; files {h['files_tracked']} "
          f"({h['files_under_benchmarks']} under benchmarks/, {h['files_counted_by']})")
    for k, v in letters.items():
        w = res.get("walks", {}).get(v)
        if w:
            path = " > ".join(_short(m, h["packages"]) for m in w.get("modules", []))
            print(f"walk {k} {v}: " + (f"{w['rooms']} rooms: {path}" if "rooms" in w else w["error"]))
    print("wrote", base + ".json", "and", base + ".png")


if __name__ == "__main__":
    main()
