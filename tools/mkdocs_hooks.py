"""mkdocs hooks for the tdstore site (see ``mkdocs.yml``).

The pages hold their examples as doctest blocks, most of them inside a fenced code block,
some as bare ``>>>`` paragraphs (doctest and GitHub both accept those). Rendered as
Markdown, a bare block would lose its line breaks and turn ``x[...]["key"]`` into a
reference link, so every bare block is wrapped in a ``pycon`` fence before rendering.
The files themselves are not changed.
"""

from __future__ import annotations

import re
from typing import Any

_FENCE = re.compile(r"^[ \t]*(```|~~~)")


def wrap_doctest_blocks(markdown: str) -> str:
    """Wraps every bare doctest block (from a ``>>>`` line to the next blank line) in a fence."""
    out: list[str] = []
    lines = markdown.split("\n")
    in_fence = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
            out.append(line)
            i += 1
            continue
        if not in_fence and line.startswith(">>> "):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out.extend(["```pycon", *block, "```"])
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return wrap_doctest_blocks(markdown)
