"""The documentation's relative links and images point at files that exist, and the dotted names
the decoders' docstrings cite (`backbone.run_decoder`, `decoders.base.OUTPUT_BOUND`) are where
they say."""
import ast
import importlib
import importlib.util
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


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Tests", 1)[1].split("\n## ", 1)[0]
    command = re.search(r"```bash\n(.*?)\n```", section, re.S).group(1).split("&&")[-1].strip()
    assert command.startswith("python -m pytest")
    assert command in (REPO / ".ci" / "run").read_text().splitlines()


# `name.name...` between backticks: a module of the library and a name defined there, a name of
# the module the docstring is in, a class of torch or transformers (its own attributes are theirs to
# keep), a configuration key, or a file.
DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
THIRD_PARTY = ("transformers", "transformers.models.t5.modeling_t5", "transformers.cache_utils")
LIBRARY = ("decoders", "datamodules", "tasks")


def docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return [doc for doc in map(ast.get_docstring, nodes) if doc]


def longest_module(dotted: str) -> tuple[object, list[str]] | None:
    """The module named by the longest importable prefix of `dotted`, and the names after it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            return importlib.import_module(".".join(parts[:cut])), parts[cut:]
        except ImportError:
            continue
    return None


def is_module(dotted: str) -> bool:
    """Whether `dotted` names a module: found, not imported (some commands run as they are)."""
    try:
        return importlib.util.find_spec(dotted) is not None
    except ImportError:  # a parent is a module, not a package
        return False


def has_path(obj, names: list[str]) -> bool:
    for name in names:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def resolves(reference: str, module) -> bool:
    """Whether `reference`, cited in a docstring of `module`, names something where it says."""
    from omegaconf import OmegaConf
    from tasks.config import compose
    first, *rest = reference.split(".")
    if reference.endswith((".py", ".toml")):
        return any((folder / reference).exists() for folder in (REPO, REPO / "decoders"))
    if first in compose():  # a configuration key, e.g. train.init_from
        return OmegaConf.select(compose(), reference, default=KeyError) is not KeyError
    if first in LIBRARY and is_module(reference):
        return True  # a module of the library, by its full name
    if hasattr(module, first):  # a name of the module itself (defined or imported there)
        target = getattr(module, first)
        third_party = getattr(target, "__module__", "").split(".")[0] not in LIBRARY
        return third_party or has_path(target, rest)
    for name in (reference, f"decoders.{reference}"):  # decoders.base.X, or backbone.X from decoders/
        found = longest_module(name)
        if found is None or not found[1] or found[0].__name__ in ("decoders", "tasks"):
            continue
        owner, (defined, *attributes) = found
        target = getattr(owner, defined, None)
        # defined in that module, not merely imported into it
        if target is not None and getattr(target, "__module__", owner.__name__) == owner.__name__:
            return has_path(target, attributes)
    return any(hasattr(importlib.import_module(root), first) for root in THIRD_PARTY) \
        or (first == "torch" and longest_module(reference) is not None)


@pytest.mark.parametrize("path", sorted((REPO / "decoders").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(REPO / "decoders")))
def test_every_dotted_name_in_the_decoders_docstrings_resolves(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    module = importlib.import_module(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    cited = {ref for doc in docstrings(path) for ref in DOTTED.findall(doc)}
    assert [ref for ref in sorted(cited) if not resolves(ref, module)] == []


def test_a_name_that_moved_does_not_resolve():
    import decoders.nar
    assert resolves("backbone.run_decoder", decoders.nar)
    assert not resolves("base.run_decoder", decoders.nar)
    assert not resolves("decoders.base.no_such_name", decoders.nar)
    assert resolves("MaskPredictDecoder.mask_predict", importlib.import_module("decoders.aggressive"))
