# The docs live in the repository: every link and cited file resolves inside a clone, and the README's lists match the code.
from __future__ import annotations

import re
from pathlib import Path

from protocol.messages import RejectionKind

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED_FILE = re.compile(
    r"`((?:docs|examples|benchmarks|tests|protocol|edge_agent|coordinator|export|bench|firmware_configs)/[\w./-]+\.(?:md|py|toml|sh))`"
)


def test_no_doc_points_outside_the_repository() -> None:
    outside = [str(doc.relative_to(ROOT)) for doc in DOCS if "../shared" in doc.read_text()]
    assert outside == []


def test_every_relative_link_and_cited_file_resolves() -> None:
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in LINK.findall(text):
            if not re.match(r"[a-z]+://", target) and not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(ROOT)} -> {target}")
        missing += [
            f"{doc.relative_to(ROOT)} -> {cited}" for cited in CITED_FILE.findall(text) if not (ROOT / cited).exists()
        ]
    assert missing == []


def test_the_readme_names_every_rejection_kind() -> None:
    readme = (ROOT / "README.md").read_text()
    assert [kind.value for kind in RejectionKind if f"`{kind.value}`" not in readme] == []
