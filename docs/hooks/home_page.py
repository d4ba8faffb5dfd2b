# MkDocs hook: the README is the site's home page (docs/index.md links to it); its links into docs/ become site links.
from __future__ import annotations

import re
from typing import Any

README_LINK = re.compile(r"\]\(docs/")


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """The home page's `](docs/X)` links, written for the README as GitHub shows it, as links to the site's page X."""
    if page.file.src_uri != "index.md":
        return markdown
    return README_LINK.sub("](", markdown)
