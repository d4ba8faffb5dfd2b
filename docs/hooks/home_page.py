# MkDocs hook: the README is the site's home page, the CHANGELOG a page of it, and links between them and the guides
# work on GitHub and here.
from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

HOME = "index.md"
ROOT_PAGES = {"README.md": HOME, "CHANGELOG.md": "changelog.md"}  # the repository's own pages, as the site names them
ROOT_TO_DOCS = re.compile(r"\]\(docs/")


def on_files(files: Files, config: Any) -> Files:
    """Adds the repository's README.md as the site's index.md and its CHANGELOG.md as changelog.md (no copies to
    keep)."""
    root = Path(config["config_file_path"]).parent
    for source, page in ROOT_PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(root / source)))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Links written for GitHub, where the README and the CHANGELOG sit above docs/: on those two pages `](docs/X`
    becomes `](X`, and on any page a link to the repository's README.md or CHANGELOG.md (not a folder's) becomes
    one to its site page."""
    folder = posixpath.dirname(page.file.src_uri)
    up_to_root = "../" * (len(folder.split("/")) + 1 if folder else 1)
    if page.file.src_uri in ROOT_PAGES.values():
        markdown, up_to_root = ROOT_TO_DOCS.sub("](", markdown), ""
    for source, site_page in ROOT_PAGES.items():
        markdown = linked_to_site(markdown, source, posixpath.relpath(site_page, folder or "."), up_to_root)
    return markdown


def linked_to_site(markdown: str, source: str, target: str, up_to_root: str) -> str:
    """Every link to the repository's `source` (reached by `up_to_root`, not a folder's file of that name) made a
    link to `target`, its site page."""
    link = re.compile(r"\]\(((?:\.\./)*)" + re.escape(source))
    return link.sub(lambda found: f"]({target}" if found.group(1) == up_to_root else found.group(0), markdown)
