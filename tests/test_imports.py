"""No import cycle among tq_hf_cache's modules, counting imports inside functions too (they are cycles all the same,
only deferred); imports under `if TYPE_CHECKING:` run nowhere and do not count."""

import ast
import os

import tq_hf_cache

PACKAGE = "tq_hf_cache"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tq_hf_cache.__file__)))


def modules(root: str, package: str) -> dict[str, str]:
    found = {}
    for dirpath, _, files in os.walk(os.path.join(root, package)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                found[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                skip.update(id(n) for n in ast.walk(inner))
    return skip


def import_graph(root: str, package: str) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its body (resolved to the longest module name)."""
    mods = modules(root, package)
    graph = {m: set() for m in mods}

    def known(name: str) -> str | None:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else None

    for mod, path in mods.items():
        tree = ast.parse(open(path).read(), path)
        skip = _type_checking_only(tree)
        here = mod.split(".") if path.endswith("__init__.py") else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                targets = [f"{base}.{a.name}" for a in node.names] or [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                target = known(t) if t.startswith(package) else None
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(import_graph(ROOT, PACKAGE))
    assert not found, "import cycles (function-level imports count):\n" + "\n".join(
        " <-> ".join(sorted(c)) for c in found)


def test_the_check_finds_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "cyc"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n    return g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import d\nfrom . import a\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert cycles(import_graph(str(tmp_path), "cyc")) == [{"cyc.a", "cyc.sub.b", "cyc.c"}]


def test_the_old_module_paths_are_the_new_modules():
    """Every old path (from before the sub-packages, `kernels.fast`) imports as the new module itself, its spec the
    new one's (a lazy relative import inside it must not warn that its package and spec disagree); a moved package's
    modules follow it."""
    import importlib
    import warnings

    import tq_hf_cache  # noqa: F401  (installs the aliases)
    from tq_hf_cache._moved import MOVED

    for old, new in MOVED.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error", ImportWarning)
            got = importlib.import_module(old)
        assert got is importlib.import_module(new) and got.__spec__.name == new, old
    assert importlib.import_module("tq_hf_cache.eval.models") is importlib.import_module("tq_hf_cache.tools.eval.models")
    assert importlib.import_module("tq_hf_cache.kernels.fast.jit") is importlib.import_module(
        "tq_hf_cache.kernels.cuda.jit")
