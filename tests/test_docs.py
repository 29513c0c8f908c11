"""The documentation's relative links and images point at files that exist."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md")),
         *sorted((REPO / "results").glob("*.md"))]
# [text](target) and ![alt](target), and <img src="target">
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|<img[^>]*\ssrc=\"([^\"]+)\"")


def relative_links(page: Path) -> list[str]:
    targets = [a or b for a, b in LINK.findall(page.read_text())]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    missing = [target for target in relative_links(page)
               if not (page.parent / target.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(REPO)} links to missing files: {missing}"


def test_the_link_pattern_finds_links_and_images(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('[a](docs/x.md#part) ![b](results/y.png "title") [c](https://example.org) '
                    '[d](#anchor) <img src="z.png" width="50%">')
    assert relative_links(page) == ["docs/x.md#part", "results/y.png", "z.png"]
