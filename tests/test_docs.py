"""The docs stay readable and connected: every top-level doc fits in 300 lines (what holds today
first, dated records in docs/history/), and every relative Markdown link in README.md and docs/
names a file that exists, and a heading there when it names one."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
MAX_LINES = 300
README_LINES = 130  # a two-minute read: reference and measured tables go to docs/

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1\s*$", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code, where a link is a link."""
    return CODE.sub("", FENCE.sub("", text))


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(prose(path.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)]  # http:, https:, mailto: ...


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: inline markup dropped, lower case, punctuation other than
    '-' and '_' removed, spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_slug_follows_github():
    assert slug("Decoding by byte products (issue 53, 2026-11-28, later the same day)") == \
        "decoding-by-byte-products-issue-53-2026-11-28-later-the-same-day"
    assert slug("Two to four bits per weight (`python scripts/bench_lowbit.py`)") == \
        "two-to-four-bits-per-weight-python-scriptsbench_lowbitpy"


def test_links_are_found_outside_code():
    text = "see [a](a.md) and [b](b.md#x), not `[c](c.md)`, [web](https://x.org)\n```\n[d](d.md)\n```\n"
    found = [t for t in LINK.findall(prose(text)) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]
    assert found == ["a.md", "b.md#x"]


@pytest.mark.parametrize("doc", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_top_level_doc_fits(doc):
    lines = len(doc.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"{doc.name} has {lines} lines (at most {MAX_LINES}): move dated, "
                                f"superseded sections to docs/history/")


def test_the_readme_is_a_two_minute_read():
    lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines (at most {README_LINES}): move reference to docs/"


def test_every_top_level_doc_is_reachable_from_the_readme_or_another_doc():
    linked = {(path.parent / target.split("#")[0]).resolve()
              for path in markdown_files() for target in links(path) if target.split("#")[0]}
    orphans = [doc.name for doc in sorted(DOCS.glob("*.md")) if doc.resolve() not in linked]
    assert orphans == []


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    broken = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(REPO)}")
    assert broken == [], f"{path.relative_to(REPO)}: " + "; ".join(broken)
