"""Real English text that ships with Python itself, for calibration and perplexity without any download.

Source: the CPython standard library module `pydoc_data.topics` (the text rendering of the Python Language
Reference / Library Reference topics that `help()` shows; written by the Python documentation authors,
PSF license). It is present in every CPython install (~465k characters; ~260k characters of prose paragraphs, ~55k SmolLM2 tokens), so nothing
here was written by this project and nothing is fetched from a hub.

`package_text(min_chars, start=...)` returns whole paragraphs in a fixed, documented order, so two
callers that ask for different `start` offsets get disjoint text (e.g. calibrate on one slice, evaluate on
another):

    calib = package_text(4_000, start=0)
    held_out = package_text(4_000, start=HELD_OUT_START)
"""

from __future__ import annotations

import re
from functools import lru_cache

TEXT_SOURCE = "CPython standard library `pydoc_data.topics` (Python Language Reference help topics, PSF license)"
# The middle paragraph of the prose: text from here on (~130k characters) never overlaps a calibration
# slice taken from start=0 with fewer than ~100k characters.
HELD_OUT_START = 500


@lru_cache(maxsize=None)
def paragraphs(prose_only: bool = True) -> tuple[str, ...]:
    """All paragraphs of the pydoc topics, topics in sorted-name order, wrapped lines joined.

    prose_only drops indented blocks (code samples, grammar rules, tables) and rst heading underlines,
    leaving running English prose.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # pragma: no cover - stripped-down Python builds only
        raise RuntimeError(f"this Python lacks the stdlib module pydoc_data.topics ({e}); no package text") from None
    out: list[str] = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = [ln for ln in block.split("\n") if ln.strip()]
            if not lines:
                continue
            if prose_only:
                if lines[0].startswith((" ", "\t")):
                    continue  # code sample / grammar / indented table
                if len(lines) >= 2 and set(lines[1].strip()) <= set("*=-~^"):
                    continue  # a heading with its underline
                if len(lines) == 1 and len(lines[0]) < 40:
                    continue
            text = " ".join(ln.strip() for ln in lines) if prose_only else "\n".join(lines)
            out.append(text)
    return tuple(out)


def package_text(min_chars: int = 20_000, start: int = 0, prose_only: bool = True) -> str:
    """At least `min_chars` characters of package-shipped English prose (whole paragraphs, "\\n\\n"-joined),
    beginning at paragraph `start`. Raises ValueError when the source holds fewer characters."""
    if isinstance(min_chars, bool) or not isinstance(min_chars, int) or min_chars < 1:
        raise ValueError(f"min_chars must be an integer >= 1, got {min_chars!r}")
    paras = paragraphs(prose_only)
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(paras):
        raise ValueError(f"start must be a paragraph index in [0, {len(paras)}), got {start!r}")
    picked, total = [], 0
    for p in paras[start:]:
        picked.append(p)
        total += len(p) + 2
        if total >= min_chars:
            return "\n\n".join(picked)
    raise ValueError(
        f"min_chars={min_chars} is more than the {total} characters available from paragraph {start} of {TEXT_SOURCE}"
    )


def total_chars(prose_only: bool = True) -> int:
    return sum(len(p) + 2 for p in paragraphs(prose_only))
