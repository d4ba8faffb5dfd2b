# MkDocs hook: the README is the site's home page, and the links between it and the guides work on GitHub and here.
from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

HOME = "index.md"
README_TO_DOCS = re.compile(r"\]\(docs/")
DOCS_TO_README = re.compile(r"\]\(((?:\.\./)+)README\.md")


def on_files(files: Files, config: Any) -> Files:
    """Adds the repository's README.md as the site's index.md (the README is the front page; no copy to keep)."""
    readme = Path(config["config_file_path"]).parent / "README.md"
    files.append(File.generated(config, HOME, abs_src_path=str(readme)))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Links written for GitHub, where the README sits above docs/: on the home page `](docs/X` becomes `](X`, and
    on a guide a link to the repository's README.md (not a folder's) becomes one to the home page."""
    if page.file.src_uri == HOME:
        return README_TO_DOCS.sub("](", markdown)
    folder = posixpath.dirname(page.file.src_uri)
    up_to_root = "../" * (len(folder.split("/")) + 1 if folder else 1)
    home = posixpath.relpath(HOME, folder or ".")
    return DOCS_TO_README.sub(lambda link: f"]({home}" if link.group(1) == up_to_root else link.group(0), markdown)
