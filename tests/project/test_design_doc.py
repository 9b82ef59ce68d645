"""The design lives in the repository (docs/design.md): every citation of it in the code and docs names an anchor
the document has, and nothing points at a design document outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
CITATION = re.compile(r"docs/design\.md#([A-Za-z0-9_-]+[A-Za-z0-9])")
OUTSIDE = re.compile(r"DESIGN\.md|DESIGN rule|the project's shared folder")  # the design once lived outside


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return [REPO / n for n in names if n.endswith((".py", ".md", ".yaml", ".sh", ".toml")) and (REPO / n).is_file()]


def anchors(text: str) -> set[str]:
    """The explicit anchors (`<a id="...">`) a markdown document defines."""
    return set(re.findall(r'<a id="([A-Za-z0-9_-]+)"></a>', text))


def test_the_anchor_reader_reads_explicit_anchors():
    assert anchors('x\n<a id="rule-a"></a>\n### A\n<a id="b"></a>') == {"rule-a", "b"}


def test_every_citation_of_the_design_names_an_anchor_it_has():
    defined = anchors(DESIGN.read_text())
    cited: dict[str, list[str]] = {}
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue  # this checker's own examples
        for anchor in CITATION.findall(path.read_text(errors="replace")):
            cited.setdefault(anchor, []).append(path.relative_to(REPO).as_posix())
    missing = {anchor: files for anchor, files in cited.items() if anchor not in defined}
    assert cited, "the code cites the design's rules by anchor (docs/design.md#rule-<name>)"
    assert not missing, f"citations of anchors docs/design.md does not define: {missing}"


def test_nothing_points_at_a_design_document_outside_the_repository():
    found = [
        f"{path.relative_to(REPO).as_posix()}:{n}"
        for path in _tracked_text_files()
        if path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, f"references to a design document outside the repository: {found}"


# Rules of this round's design whose code is still being built: cited once it lands (then removed from here).
NOT_YET_CITED: dict[str, str] = {}


def test_every_rule_of_the_design_is_cited_somewhere():
    """A rule nobody cites is a rule nobody reads: each anchor is cited by the code, the tests or the README."""
    defined = {a for a in anchors(DESIGN.read_text()) if a.startswith("rule-")}
    cited = {a for path in _tracked_text_files() if path != DESIGN for a in CITATION.findall(path.read_text())}
    assert not defined - cited - set(NOT_YET_CITED), f"rules no file cites: {sorted(defined - cited)}"
    assert not cited & set(NOT_YET_CITED), f"cited now, remove from NOT_YET_CITED: {sorted(cited & set(NOT_YET_CITED))}"
