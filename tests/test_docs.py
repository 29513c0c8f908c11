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


# How the project was made is not the users' business: no stops, rounds, sessions, issues or
# machines that were lent or not, no commit ids as narrative, and no folder users do not have.
HISTORY = re.compile("|".join([
    r"\b(this|that|previous|last|next|earlier|later|each|every|one) (stop|round|session)s?\b",
    r"\b(stop|round|session) \d+", r"\bsessions?\b", r"\bissues?\b", r"\blent\b",
    r"\bcommit [0-9a-f]{7,}", r"\.\./shared", r"/work/",
]), re.IGNORECASE)


def history_phrases(text: str) -> list[str]:
    return [match.group(0) for match in HISTORY.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_tells_how_the_project_was_made(page):
    found = history_phrases(page.read_text())
    assert not found, f"{page.relative_to(REPO)} says how the project was made: {found}"


def test_the_history_pattern_finds_such_phrases():
    text = ("measured in this session; the previous round's table; stop 31; as the issue asks; "
            "no GPU was lent; see commit a443847; data in ../shared/data")
    assert len(history_phrases(text)) == 7
    assert history_phrases("a round trip; rounded up; the stop rule; stop_rule=all_end; "
                           "a first_empty subsequence stops new starts") == []


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Tests", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).split("&&")[-1].strip()
    assert command.startswith("python -m pytest")
    assert command in (REPO / ".ci" / "run").read_text().splitlines()
