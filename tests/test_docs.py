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
    path = os.path.join(root, "tq_hf_cache", "quant", "packed_kv.py")
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


# --- citations: every file a doc cites exists (or existed at the commit cited with it), and every result is cited ----

import fnmatch
import glob
import re

RESULTS = "benchmarks/results"
# a repository path a doc may cite: results, studies, benchmark scripts, examples, scripts
_CITE = re.compile(r"(?<![A-Za-z0-9_./-])(?:benchmarks|examples|scripts)(?:/[A-Za-z0-9_.{},*<>\-]*)+")
# "at commit abc1234" / "commit abc1234": a citation in the same sentence after it, or right before "at commit
# abc1234", names a file as it was at that commit (git history is the archive), so it may be absent now
_COMMIT = re.compile(r"\bcommit ([0-9a-f]{7,40})\b")
_COMMIT_AFTER = re.compile(r"`?[ ,]*\(?at commit ([0-9a-f]{7,40})\b")
_SENTENCE_END = re.compile(r"\.\s|;|\n\s*\n")


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


def _commit_of(text: str, start: int, end: int) -> str | None:
    """The commit a citation at text[start:end] is cited at: "at commit H" right after it, or the last "commit H"
    before it in the same sentence (at most 300 characters back); None for a citation of the current tree."""
    after = _COMMIT_AFTER.match(text, end)
    if after:
        return after.group(1)
    before = None
    for m in _COMMIT.finditer(text, max(0, start - 300), start):
        before = m
    if before is not None and not _SENTENCE_END.search(text, before.end(), start):
        return before.group(1)
    return None


def _citations_at(text: str) -> list[tuple[str, str | None]]:
    """(path, commit) for every path a text cites, braces expanded, placeholders as globs, trailing punctuation and
    slashes dropped; commit is None where the citation is of the current tree."""
    out = []
    for m in _CITE.finditer(text):
        raw = re.sub(r"<[^<>/]*>", "*", m.group(0))  # a placeholder such as quality_<model>.json
        commit = _commit_of(text, m.start(), m.end())
        for path in _expand_braces(raw.rstrip(".,:")):
            path = path.rstrip("/.,:")
            if "/" in path:
                out.append((path, commit))
    return out


def _citations(text: str) -> list[str]:
    """The current-tree paths a text cites (see `_citations_at`)."""
    return [path for path, commit in _citations_at(text) if commit is None]


def _result_files() -> list[str]:
    """Every committed file under benchmarks/results/, as repository-relative paths."""
    files = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, RESULTS)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        files += [os.path.relpath(os.path.join(dirpath, name), ROOT).replace(os.sep, "/") for name in filenames]
    return sorted(files)


def _covers(citation: str, path: str) -> bool:
    """A citation covers a file when it names it, matches it as a glob, or names a folder above it (not the results
    folder itself)."""
    if citation in (RESULTS, "benchmarks"):
        return False
    return fnmatch.fnmatchcase(path, citation) or path.startswith(citation + "/")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=60)


def _tree_at(commit: str) -> list[str] | None:
    """The files of the repository at a commit, or None where git or the commit is not here (a shallow clone)."""
    try:
        run = _git("ls-tree", "-r", "--name-only", commit)
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.splitlines() if run.returncode == 0 else None


def test_every_cited_file_exists():
    """A path named in the docs, the README or the changelog must exist (after brace expansion; a glob must match
    something), unless it is cited at a commit: then it must have existed at that commit, where this checkout has
    that commit's history."""
    missing, trees = [], {}
    for name, text in _doc_texts(with_changelog=True).items():
        for citation, commit in _citations_at(text):
            if commit is None:
                if not glob.glob(os.path.join(ROOT, citation)):
                    missing.append(f"{name}: {citation}")
                continue
            if commit not in trees:
                trees[commit] = _tree_at(commit)
            tree = trees[commit]
            if tree is not None and not any(_covers(citation, path) or path == citation for path in tree):
                missing.append(f"{name}: {citation} (at commit {commit})")
    assert not missing, "cited files that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_result_is_cited_by_a_current_doc():
    """Each file under benchmarks/results/ backs a statement of docs/*.md or README.md, by its path or its folder's
    (cited of the current tree, not at a commit); history in CHANGELOG.md does not count. Delete the others: git
    keeps them, and a doc that still needs a figure cites the file at its commit."""
    citations = {c for text in _doc_texts(with_changelog=False).values() for c in _citations(text)}
    uncited = [path for path in _result_files() if not any(_covers(c, path) for c in citations)]
    assert not uncited, (f"{len(uncited)} result files no doc cites (cite them where a current statement rests on "
                         "them, or delete them and cite them at a commit):\n" + "\n".join(uncited))


def test_every_image_of_the_manual_is_shown():
    """Every PNG under docs/ is referenced by a doc page or the README."""
    texts = "\n".join(_doc_texts(with_changelog=False).values())
    images = sorted(glob.glob(os.path.join(ROOT, "docs", "*.png")) + glob.glob(os.path.join(ROOT, "docs", "img", "*.png")))
    unused = [os.path.relpath(p, ROOT) for p in images
              if os.path.relpath(p, os.path.join(ROOT, "docs")).replace(os.sep, "/") not in texts]
    assert not unused, "images no page shows (reference or delete them):\n" + "\n".join(unused)


def test_the_citation_check_catches_a_missing_and_an_uncited_file():
    """The guard itself: brace patterns expand, a folder covers its files, a missing path is not covered, and only a
    citation beside a commit is one of history."""
    assert _citations("`benchmarks/results/bench_prefix_{h100,cpu}.*`.") == [
        "benchmarks/results/bench_prefix_h100.*", "benchmarks/results/bench_prefix_cpu.*"]
    assert _citations("--merged-json 'benchmarks/results/quality_{model}.json'") == ["benchmarks/results/quality_*.json"]
    assert _citations("benchmarks/results/quality_<model>.json") == ["benchmarks/results/quality_*.json"]
    assert _covers("benchmarks/results/allocations", "benchmarks/results/allocations/smollm2-2/turboquant_config.json")
    assert _covers("benchmarks/results/bench_prefix_h100.*", "benchmarks/results/bench_prefix_h100.png")
    assert not _covers("benchmarks/results", "benchmarks/results/bench_prefix_h100.png")
    assert not _covers("benchmarks/results/bench_prefix_h100.json", "benchmarks/results/bench_prefix_h100.png")
    assert not glob.glob(os.path.join(ROOT, "benchmarks/results/no_such_result.json"))
    old = "benchmarks/results/archive/x.json"
    assert _citations_at(f"measured at commit abc1234, `{old}` there.") == [(old, "abc1234")]
    assert _citations_at(f"(`{old}` at commit abc1234)") == [(old, "abc1234")]
    assert _citations_at(f"(`{old}`, at commit abc1234)") == [(old, "abc1234")]
    # a commit of another sentence, or a kernel named by its hash without "commit", makes no citation historical
    assert _citations_at(f"Since commit abc1234 it is faster. Result: `{old}`.") == [(old, None)]
    assert _citations_at(f"the kernel of abc1234 (`{old}`)") == [(old, None)]
    assert _citations_at("python benchmarks/bench_decode.py --out DIR") == [("benchmarks/bench_decode.py", None)]


def test_every_study_is_cited_by_a_current_doc():
    """A script under benchmarks/studies/ stays while docs/*.md or README.md cite it by its path (it makes a figure a
    doc shows, or a study the doc says is open); a concluded study leaves (git keeps it) and the doc gives its
    conclusion with the commit that holds it."""
    texts = "\n".join(_doc_texts(with_changelog=False).values())
    studies = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "studies", "*")))
    uncited = [os.path.relpath(p, ROOT) for p in studies if os.path.isfile(p)
               and os.path.relpath(p, ROOT).replace(os.sep, "/") not in texts]
    assert not uncited, "studies no current doc cites (cite them where the docs rest on them, or delete them):\n" + \
        "\n".join(uncited)
