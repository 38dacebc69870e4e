"""The house of scripts/house.py, read from this repository's source: no import cycle, and the kernels never import
the transformers glue (the layers, caches, attention and prefix modules); its counting on a made-up package."""

import fnmatch
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE = ("layer*", "cache", "static_cache", "attention", "prefix*")


def _load():
    spec = importlib.util.spec_from_file_location("house", os.path.join(ROOT, "scripts", "house.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


house = _load()


@pytest.fixture(scope="module")
def repo():
    mods = house.rooms(ROOT)
    return mods, house.arrows(mods)


def test_no_import_cycle(repo):
    mods, found = repo
    _, cycles = house.floors(list(mods), [k for k, v in found.items() if v != "typing"])
    assert not cycles, "import cycles (imports inside functions count): " + "; ".join(" <-> ".join(c) for c in cycles)


def test_kernels_never_import_the_glue(repo):
    """Any import, lazy or under TYPE_CHECKING alike: the dependency points from the glue to the kernels only."""
    mods, found = repo
    assert any(m.startswith("tq_hf_cache.kernels.") for m in mods)
    bad = [(a, b, kind) for (a, b), kind in found.items()
           if (a == "tq_hf_cache.kernels" or a.startswith("tq_hf_cache.kernels."))
           and any(fnmatch.fnmatch(part, g) for part in b.split(".")[1:] for g in GLUE)]
    assert not bad, bad


def test_rooms_arrows_floors_and_classes_of_a_made_up_package(tmp_path):
    pkg = tmp_path / "tq_hf_cache"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from .sub import b\n\n\n@dec\nclass A:\n    x = 1\n\n    class Inner:\n        pass\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import os\n\n\ndef f():\n    import tq_hf_cache.c as c\n    return c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    mods = house.rooms(str(tmp_path))
    assert set(mods) == {"tq_hf_cache", "tq_hf_cache.a", "tq_hf_cache.sub", "tq_hf_cache.sub.b", "tq_hf_cache.c"}
    found = house.arrows(mods)
    assert found == {("tq_hf_cache", "tq_hf_cache.a"): "eager", ("tq_hf_cache.a", "tq_hf_cache.sub.b"): "eager",
                     ("tq_hf_cache.sub.b", "tq_hf_cache.c"): "lazy", ("tq_hf_cache.c", "tq_hf_cache.a"): "typing"}
    floor_of, cycles = house.floors(list(mods), [k for k, v in found.items() if v != "typing"])
    assert cycles == []
    assert floor_of == {"tq_hf_cache.c": 0, "tq_hf_cache.sub": 0, "tq_hf_cache.sub.b": 1, "tq_hf_cache.a": 2,
                        "tq_hf_cache": 3}
    _, cycles = house.floors(list(mods), list(found))
    assert cycles == [["tq_hf_cache.a", "tq_hf_cache.c", "tq_hf_cache.sub.b"]]
    assert house.classes(mods)[:2] == [{"name": "A", "module": "tq_hf_cache.a", "lines": 6},
                                       {"name": "Inner", "module": "tq_hf_cache.a", "lines": 2}]
