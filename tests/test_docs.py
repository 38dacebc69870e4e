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


# --- result citations: every committed result backs a current statement, and every cited result exists ---------

import fnmatch
import glob
import re

RESULTS = "benchmarks/results"
_CITE = re.compile(r"benchmarks/results(?:/[A-Za-z0-9_.{},*<>\-]*)*")


def _expand_braces(pattern: str) -> list[str]:
    """Shell brace expansion of `{a,b}` groups (recursively); a group without a comma (`{model}`) is a placeholder
    and matches anything."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    options = m.group(1).split(",") if "," in m.group(1) else ["*"]
    return [p for option in options for p in _expand_braces(head + option + tail)]


def _doc_texts(with_changelog: bool) -> dict[str, str]:
    paths = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
    if with_changelog:
        paths.append(os.path.join(ROOT, "CHANGELOG.md"))
    texts = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            texts[os.path.relpath(path, ROOT)] = f.read()
    return texts


def _citations(text: str) -> list[str]:
    """The result paths a text cites, braces expanded, trailing punctuation and slashes dropped."""
    out = []
    for raw in _CITE.findall(text):
        raw = re.sub(r"<[^<>/]*>", "*", raw)  # a placeholder such as quality_<model>.json
        for path in _expand_braces(raw.rstrip(".,:")):
            out.append(path.rstrip("/.,:"))
    return out


def _result_files() -> list[str]:
    """Every committed file under benchmarks/results/ but the archive, as repository-relative paths."""
    files = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, RESULTS)):
        dirnames[:] = [d for d in dirnames if d not in ("archive", "__pycache__")]
        files += [os.path.relpath(os.path.join(dirpath, name), ROOT).replace(os.sep, "/") for name in filenames]
    return sorted(files)


def _covers(citation: str, path: str) -> bool:
    """A citation covers a file when it names it, matches it as a glob, or names a folder above it (not the results
    folder itself, nor the archive)."""
    if citation in (RESULTS, RESULTS + "/archive") or citation.startswith(RESULTS + "/archive/"):
        return False
    return fnmatch.fnmatchcase(path, citation) or path.startswith(citation + "/")


def test_every_cited_result_exists():
    """A path under benchmarks/results/ named in the docs, the README or the changelog must exist (after brace
    expansion; a glob must match something)."""
    missing = []
    for name, text in _doc_texts(with_changelog=True).items():
        for citation in _citations(text):
            if not glob.glob(os.path.join(ROOT, citation)):
                missing.append(f"{name}: {citation}")
    assert not missing, "cited results that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_result_is_cited_by_a_current_doc():
    """Each file under benchmarks/results/ (outside archive/) backs a statement of docs/*.md or README.md, by its
    path or its folder's; history in CHANGELOG.md does not count. Move the others to benchmarks/results/archive/."""
    citations = {c for text in _doc_texts(with_changelog=False).values() for c in _citations(text)}
    uncited = [path for path in _result_files() if not any(_covers(c, path) for c in citations)]
    assert not uncited, (f"{len(uncited)} result files no doc cites (cite them where a current statement rests on "
                         "them, or git mv them to benchmarks/results/archive/):\n" + "\n".join(uncited))


def test_every_image_of_the_manual_is_shown():
    """Every PNG under docs/ is referenced by a doc page or the README."""
    texts = "\n".join(_doc_texts(with_changelog=False).values())
    images = sorted(glob.glob(os.path.join(ROOT, "docs", "*.png")) + glob.glob(os.path.join(ROOT, "docs", "img", "*.png")))
    unused = [os.path.relpath(p, ROOT) for p in images
              if os.path.relpath(p, os.path.join(ROOT, "docs")).replace(os.sep, "/") not in texts]
    assert not unused, "images no page shows (reference or delete them):\n" + "\n".join(unused)


def test_the_citation_check_catches_a_missing_and_an_uncited_file():
    """The guard itself: brace patterns expand, a folder covers its files, a missing path and the archive are not
    covers."""
    assert _citations("`benchmarks/results/bench_prefix_{h100,cpu}.*`.") == [
        "benchmarks/results/bench_prefix_h100.*", "benchmarks/results/bench_prefix_cpu.*"]
    assert _citations("--merged-json 'benchmarks/results/quality_{model}.json'") == ["benchmarks/results/quality_*.json"]
    assert _citations("benchmarks/results/quality_<model>.json") == ["benchmarks/results/quality_*.json"]
    assert _covers("benchmarks/results/allocations", "benchmarks/results/allocations/smollm2-2/turboquant_config.json")
    assert _covers("benchmarks/results/bench_prefix_h100.*", "benchmarks/results/bench_prefix_h100.png")
    assert not _covers("benchmarks/results", "benchmarks/results/bench_prefix_h100.png")
    assert not _covers("benchmarks/results/archive", "benchmarks/results/archive/x.json")
    assert not _covers("benchmarks/results/bench_prefix_h100.json", "benchmarks/results/bench_prefix_h100.png")
    assert not glob.glob(os.path.join(ROOT, "benchmarks/results/no_such_result.json"))


def test_every_study_is_cited_by_a_current_doc():
    """A script under benchmarks/studies/ stays while docs/*.md or README.md cite it by its path (its conclusion is in
    the docs); then it leaves (git keeps it), as the guide's "experiments leave when their conclusion is in the docs"."""
    texts = "\n".join(_doc_texts(with_changelog=False).values())
    studies = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "studies", "*")))
    uncited = [os.path.relpath(p, ROOT) for p in studies if os.path.isfile(p)
               and os.path.relpath(p, ROOT).replace(os.sep, "/") not in texts]
    assert not uncited, "studies no current doc cites (cite them where the docs rest on them, or delete them):\n" + \
        "\n".join(uncited)
