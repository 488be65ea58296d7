"""The README stays a front door and every relative link in the docs resolves.

A link is checked as GitHub renders it: relative to the page, with ``#anchor`` matched
against the target page's headings (GitHub's slugs). Links inside code blocks are not
links and are skipped.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The page without its fenced code blocks and inline code spans."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lowercase, punctuation dropped, spaces as hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", page.read_text())):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto:


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 260, f"README.md has {lines} lines; keep it at most 260 and move detail into docs/"


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file or heading does not exist, saying which."""
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [gone](missing.md) [bad](#nowhere)\n"
                    "![chart](page.md) [web](https://example.com/x.md)\n"
                    "```\n[in code](not-a-link.md)\n```\n")
    assert relative_links(page) == ["page.md#title", "missing.md", "#nowhere", "page.md"]
    assert broken_links(page) == ["missing.md: no such file", "#nowhere: no heading #nowhere in page.md"]
