# The docs live in the repository: every link and cited file resolves inside a clone, the site builds strictly, the
# README stays a front page, and the docs' lists match the code.
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from protocol.messages import RejectionKind

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"
SITE_PAGES_OF_ROOT = {"README.md": "index.md", "CHANGELOG.md": "changelog.md"}  # docs/hooks/home_page.py's ROOT_PAGES
PAGES = sorted((ROOT / "docs").rglob("*.md"))
DOCS = [README, CHANGELOG, *PAGES, *sorted((ROOT / "examples").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CITED_FILE = re.compile(
    r"`((?:docs|examples|benchmarks|tests|protocol|edge_agent|coordinator|export|bench|firmware_configs)/[\w./-]+\.(?:md|py|toml|sh))`"
)
README_MOST_LINES = 250


def test_no_doc_points_outside_the_repository() -> None:
    outside = [str(doc.relative_to(ROOT)) for doc in DOCS if "../shared" in doc.read_text()]
    assert outside == []


def test_every_relative_link_and_cited_file_resolves() -> None:
    """As GitHub shows them: the README from the root (its links into docs/ included), every docs page from its
    folder, cited code paths from the root."""
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


def test_the_readme_is_a_front_page_whose_links_stay_in_the_site() -> None:
    """Under 250 lines, and every relative link goes into docs/ or to the CHANGELOG (the site's home page,
    docs/hooks/home_page.py's index.md, rewrites exactly those)."""
    text = README.read_text()
    assert len(text.splitlines()) < README_MOST_LINES
    relative = [target for target in LINK.findall(text) if not re.match(r"[a-z]+://", target)]
    outside = [target for target in relative if not target.startswith("docs/") and target not in SITE_PAGES_OF_ROOT]
    assert relative and outside == []


def nav_pages(entries: list) -> list[str]:
    """Every page path a MkDocs nav names, depth first."""
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_docs_page_is_in_the_nav() -> None:
    """The nav names each page once (and the README's and the CHANGELOG's pages): no page is an orphan, none is
    listed twice."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    listed = nav_pages(config["nav"])
    on_disk = [*SITE_PAGES_OF_ROOT.values(), *(str(path.relative_to(ROOT / "docs")) for path in PAGES)]
    assert sorted(listed) == sorted(on_disk)


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """`make docs`' build: a broken link or anchor, or a page outside the nav, fails it."""
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert build.returncode == 0, build.stderr[-3000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'href="camera.html"' in home and 'href="docs/' not in home
    guide = (tmp_path / "site" / "camera.html").read_text()
    assert 'href="index.html#the-camera-path-in-ten-lines"' in guide and "README.md" not in guide
    changelog = (tmp_path / "site" / "changelog.html").read_text()
    assert 'href="deployment.html#upgrading-to-a-new-release"' in changelog and 'href="docs/' not in changelog
    upgrading = (tmp_path / "site" / "deployment.html").read_text()
    assert 'href="changelog.html"' in upgrading and "CHANGELOG.md" not in upgrading
    assert 'href="changelog.html"' in home


def test_the_protocol_page_names_every_rejection_kind() -> None:
    protocol = (ROOT / "docs" / "protocol.md").read_text()
    assert [kind.value for kind in RejectionKind if f"`{kind.value}`" not in protocol] == []


ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
RUNTIME_ROOMS = ("protocol", "edge_agent", "export", "coordinator", "bench")
ROOM_HEADING = re.compile(r"^### `(\w+)/`$")
MODULE_ROW = re.compile(r"^\| `([\w/]+)` \|")
LONGEST_CELL = 300


def runtime_modules() -> list[str]:
    """Every module of the runtime rooms, dotted (a package's `__init__` is the package, not a module of its own)."""
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for room in RUNTIME_ROOMS
        for path in (ROOT / room).rglob("*.py")
        if path.stem != "__init__"
    )


def module_rows(page: str) -> list[str]:
    """The module each row of a page's room tables names, dotted: the room from the `### `room/`` heading above it."""
    rows, room = [], None
    for line in page.splitlines():
        heading = ROOM_HEADING.match(line)
        if heading or line.startswith("## "):
            room = heading.group(1) if heading else None
        row = MODULE_ROW.match(line)
        if room and row:
            rows.append(f"{room}.{row.group(1).replace('/', '.')}")
    return rows


def test_the_architecture_page_has_exactly_one_row_per_runtime_module() -> None:
    modules, rows = runtime_modules(), module_rows(ARCHITECTURE.read_text())
    assert {"without a row": sorted(set(modules) - set(rows)), "not a module": sorted(set(rows) - set(modules))} == {
        "without a row": [],
        "not a module": [],
    }
    assert sorted({row for row in rows if rows.count(row) > 1}) == []


def test_the_row_reader_sees_rooms_rows_and_the_end_of_a_room() -> None:
    page = "### `edge_agent/`\n| module | job |\n| `loop/agent` | x |\n## Decisions\n| `loop/outbox` | y |\n"
    assert module_rows(page) == ["edge_agent.loop.agent"]


def test_no_table_cell_of_the_architecture_page_runs_long() -> None:
    cells = [
        cell.strip()
        for line in ARCHITECTURE.read_text().splitlines()
        if line.startswith("|")
        for cell in re.split(r"(?<!\\)\|", line.strip("|"))
    ]
    assert [cell[:80] for cell in cells if len(cell) > LONGEST_CELL] == []


def test_the_readme_layout_names_every_room_and_inner_room() -> None:
    layout = README.read_text().split("## Layout", 1)[1].split("```")[1]
    rooms = [f"{room}/" for room in RUNTIME_ROOMS] + [
        f"{path.name}/"
        for room in ("protocol", "edge_agent", "coordinator")
        for path in sorted((ROOT / room).iterdir())
        if (path / "__init__.py").exists()
    ]
    assert [room for room in rooms if not re.search(rf"(?<![\w/]){room}", layout)] == []
