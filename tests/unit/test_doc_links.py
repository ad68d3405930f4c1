"""Every relative link in the docs resolves: the file exists, and an anchor names a heading of it
(issue 46: benchmarks/README.md was split by benchmark, and links into it had to follow).

Checked: README.md, docs/*.md, benchmarks/*.md. Anchors follow GitHub's rules: the heading's
text (code spans and link text kept, markup dropped) lowercased, everything but letters,
digits, ``_``, ``-`` and spaces dropped, spaces turned into ``-``; a repeated heading gets
``-1``, ``-2``, ... Headings and links inside fenced code blocks and code spans do not count.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^\s{0,3}(```|~~~)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def doc_files(root: Path = ROOT) -> list[Path]:
    """The checked markdown files under ``root``."""
    files = [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "benchmarks").glob("*.md")),
    ]
    return [f for f in files if f.is_file()]


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = _FENCE.match(line)
        if match:
            if fence is None:
                fence = match.group(1)
            elif match.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = _INLINE_LINK.sub(r"\1", heading)
    text = _CODE_SPAN.sub(r"\2", text)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor the headings of a markdown file define."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, target) of every inline link and image outside code."""
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(_CODE_SPAN.sub("", line)):
            yield number, match.group(1)


def broken_links(files: Iterable[Path], root: Path = ROOT) -> list[str]:
    """``file:line: target (why)`` for every relative link that does not resolve."""
    cache: dict[Path, set[str]] = {}
    broken: list[str] = []
    for path in files:
        for number, target in links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path.resolve()
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
                continue
            if not anchor or dest.suffix != ".md":
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                broken.append(f"{where} (no heading #{anchor})")
    return broken


def test_every_doc_link_resolves() -> None:
    files = doc_files()
    assert {f.name for f in files} >= {"README.md", "design.md", "operations.md", "benchmarks.md"}
    assert broken_links(files) == []


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Cost of keys and page signatures (`benchmarks/key_cost.py`, issue 14)") == (
        "cost-of-keys-and-page-signatures-benchmarkskey_costpy-issue-14"
    )
    assert slug("The data path on a GPU: built, proven at the tensor level on an H100") == (
        "the-data-path-on-a-gpu-built-proven-at-the-tensor-level-on-an-h100"
    )
    assert slug("Inside the engine: where a hit's time goes (issue 16)") == (
        "inside-the-engine-where-a-hits-time-goes-issue-16"
    )
    assert slug("A [linked](x.md) *word*") == "a-linked-word"


def test_the_check_catches_broken_links(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n\n## Run it\n\n## Run it\n\n"
        "```bash\n# not a heading\n[not a link](nowhere.md)\n```\n\n"
        "[ok](docs/a.md#a-section) [ok](#run-it-1) [ok](#top) `[code](nowhere.md)`\n"
        "[gone](docs/a.md#moved-away) [dup](#run-it-2) [fenced](#not-a-heading)\n"
        "[file](docs/missing.md) ![img](benchmarks/results/x.png) [web](https://example.com/#x)\n"
    )
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## A section\n\n[back](../README.md#run-it)\n")
    broken = broken_links(doc_files(tmp_path), tmp_path)
    assert broken == [
        "README.md:13: docs/a.md#moved-away (no heading #moved-away)",
        "README.md:13: #run-it-2 (no heading #run-it-2)",
        "README.md:13: #not-a-heading (no heading #not-a-heading)",
        "README.md:14: docs/missing.md (no such file)",
        "README.md:14: benchmarks/results/x.png (no such file)",
    ]
