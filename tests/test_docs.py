"""The manual builds with `mkdocs build --strict`, and a docstring warning fails that build (CI runs it)."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("mkdocs", reason="the docs extra (mkdocs, mkdocstrings) is not installed")
pytest.importorskip("mkdocstrings")


def _build(root: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=root, capture_output=True, text=True, timeout=300)


def _copy(tmp_path) -> str:
    root = str(tmp_path / "repo")
    for name in ("docs", "tq_hf_cache", "benchmarks", "examples"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(root, name),
                        ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.png"))
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md"):
        shutil.copy(os.path.join(ROOT, name), root)
    for png in ("quality_vs_bytes.png",):
        shutil.copy(os.path.join(ROOT, "docs", png), os.path.join(root, "docs", png))
    shutil.copytree(os.path.join(ROOT, "docs", "img"), os.path.join(root, "docs", "img"), dirs_exist_ok=True)
    return root


def test_the_manual_builds_strict(tmp_path):
    run = _build(ROOT, tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "WARNING" not in run.stderr, run.stderr[-4000:]


def test_a_docstring_warning_fails_the_strict_build(tmp_path):
    """The guard itself: a planted docstring naming a parameter the signature lacks must abort the build."""
    root = _copy(tmp_path)
    path = os.path.join(root, "tq_hf_cache", "packed_kv.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    planted = text.replace("        store: the uint8 buffer laid out by `static_parts`.",
                           "        store: the uint8 buffer laid out by `static_parts`.\n        nowhere: not a field.", 1)
    assert planted != text, "the planted line found no anchor in packed_kv.py"
    with open(path, "w", encoding="utf-8") as f:
        f.write(planted)
    run = _build(root, tmp_path)
    assert run.returncode != 0, "a docstring warning did not fail mkdocs build --strict"
    assert "nowhere" in run.stderr
