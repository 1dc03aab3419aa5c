"""The code, profiles and docs cite DESIGN.md by section: the file is in the repository and every
cited section exists (a newcomer following a citation lands on it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CITATION = re.compile(r"DESIGN\.md (?:§ ?|section )(\d+)")


def test_every_cited_section_of_design_md_exists() -> None:
    sections = {int(m) for m in re.findall(r"^## (\d+)\. ", (ROOT / "DESIGN.md").read_text(), flags=re.M)}
    tracked = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.toml"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    cited = {(path, int(n)) for path in tracked for n in CITATION.findall((ROOT / path).read_text())}
    assert cited, "no citation of DESIGN.md found: the pattern no longer matches how the code cites it"
    assert not {(path, n) for path, n in cited if n not in sections}, sorted(sections)
