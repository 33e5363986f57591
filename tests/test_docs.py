"""The README is for users and stays short; the reference lives in docs/, every page of it linked from the
README, and no link in either leads nowhere."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300
LINK = re.compile(r"\]\(([^)\s]+)\)")


def targets(text: str) -> list[str]:
    """The relative targets of a Markdown text's links and images (web addresses and anchors left out)."""
    return [t.split("#")[0] for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines: move reference material into docs/"


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t).resolve() for t in targets(README.read_text())}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md does not link: {missing}"


def test_every_link_leads_to_a_file():
    broken = [f"{page.relative_to(ROOT)} -> {t}" for page in [README, *sorted(DOCS.glob("*.md"))]
              for t in targets(page.read_text()) if not (page.parent / t).exists()]
    assert not broken, f"links to nothing: {broken}"


def test_a_broken_link_is_found():
    assert targets("[a](docs/x.md#part) ![b](../screenshots/y.png) [c](https://example.org) [d](#here)") == \
        ["docs/x.md", "../screenshots/y.png"]
