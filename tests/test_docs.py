"""The documentation's links hold: every relative link in README.md and docs/*.md names a file of the repository
and, after a #, a heading of that file (as GitHub makes anchors of headings). The README is a front door to docs/,
so a section moved or renamed there must not leave a link pointing at nothing."""

import re
from pathlib import Path

import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a file's headings: lower case, punctuation dropped, spaces to hyphens, a repeated
    heading numbered -1, -2..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", markdown), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not this repository's
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved.read_text())):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_an_existing_file_and_heading(path):
    assert broken_links(path) == [], f"{path.relative_to(REPO)}: broken links"


def test_a_link_to_a_missing_file_or_heading_is_found(tmp_path):
    (tmp_path / "OTHER.md").write_text("# Other\n\n## A section, renamed\n\n```\n# not a heading\n```\n")
    doc = tmp_path / "DOC.md"
    doc.write_text("[ok](OTHER.md#a-section-renamed) [here](#doc) [web](https://example.com/x.md)\n\n# Doc\n\n"
                   "[gone](MISSING.md) [moved](OTHER.md#a-section) [fenced](OTHER.md#not-a-heading)\n"
                   "```\n[in code](NOWHERE.md)\n```\n")
    assert broken_links(doc) == [f"MISSING.md: no file {tmp_path / 'MISSING.md'}",
                                 "OTHER.md#a-section: no heading #a-section in OTHER.md",
                                 "OTHER.md#not-a-heading: no heading #not-a-heading in OTHER.md"]


def test_the_readme_maps_every_file_of_docs():
    readme = (REPO / "README.md").read_text()
    assert [p.name for p in DOCS[1:] if f"](docs/{p.name})" not in readme] == []


TEST_REF = re.compile(r"(?:(\w+\.py)|…)::(test_\w+)")


def missing_tests(markdown: str, tests_dir: Path) -> list[str]:
    """The tests a document names that no test file defines: as `file.py::test_name`, a test of that file; as
    `…::test_name` (the file said by the text around it), a test of any file. A test renamed or removed leaves the
    document pointing at nothing."""
    defined = {f.name: set(re.findall(r"^def (test_\w+)\(", f.read_text(), re.M)) for f in tests_dir.glob("*.py")}
    anywhere = set().union(*defined.values())
    return [f"{file or '…'}::{name}" for file, name in TEST_REF.findall(markdown)
            if name not in (defined.get(file, set()) if file else anywhere)]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_a_document_names_exists(path):
    assert missing_tests(path.read_text(), REPO / "tests") == [], f"{path.relative_to(REPO)}: tests not found"


def test_a_renamed_test_is_found(tmp_path):
    (tmp_path / "test_x.py").write_text("def test_kept():\n    pass\n")
    (tmp_path / "test_y.py").write_text("def test_other():\n    pass\n")
    doc = ("`test_x.py::test_kept`, `…::test_other`, `…::test_renamed`; `tests/test_x.py::test_kept`; "
           "`test_gone.py::test_kept`; `test_x.py::test_other`")
    assert missing_tests(doc, tmp_path) == ["…::test_renamed", "test_gone.py::test_kept", "test_x.py::test_other"]
