"""How a benchmark writes its results into docs/benchmarks.md: one marked section per benchmark,
replaced on a rerun, hand-written notes inside it kept, and the cell formatters its tables use."""

from __future__ import annotations

from pathlib import Path

# The repository checkout these modules run from, if they do: the benchmarks record their results
# in its docs/. Installed from a wheel, floodgate/bench/.. is the installed package, which has no
# docs/ (and in the container image belongs to root): results go under the working directory
# there, and no doc is updated unless --doc names one.
_CHECKOUT_DOCS = Path(__file__).resolve().parents[1] / "docs"


def in_checkout() -> bool:
    return (_CHECKOUT_DOCS / "benchmarks.md").is_file()


def default_out(name: str) -> Path:
    """Where benchmark `name` writes its raw results and plots unless --out says otherwise."""
    return _CHECKOUT_DOCS / "benchmarks" / name if in_checkout() else Path("runs") / "bench" / name


def default_doc() -> Path | None:
    """The markdown file a benchmark updates unless --doc says otherwise (None: none)."""
    return _CHECKOUT_DOCS / "benchmarks.md" if in_checkout() else None


def replace_section(doc: Path, start: str, end: str, section: str, *, heading: str = "") -> None:
    """Replace the text between the `start` and `end` markers (markers included) with `section`,
    or append `heading` + `section` when the doc has no such markers; never touch the rest."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if start in text and end in text:
        a = text.index(start)
        b = text.index(end) + len(end)
        text = text[:a] + section.strip() + text[b:]
    else:
        text = text.rstrip() + "\n\n" + heading + section.strip() + "\n"
    doc.write_text(text)


def kept_notes(doc: Path, begin: str, end: str, default: str) -> str:
    """The hand-written block between `begin` and `end` (markers included), so a rerun keeps
    the analysis written after the last full run; `default` when there is none yet."""
    if not doc.exists():
        return default
    text = doc.read_text()
    a, b = text.find(begin), text.find(end)
    if a < 0 or b < a:
        return default
    return text[a:b + len(end)]


def pct(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{100 * v:.{digits}f}%"


def num(v: float | None, fmt: str = ".0f") -> str:
    return "–" if v is None else format(v, fmt)
