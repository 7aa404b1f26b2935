"""MkDocs hooks (mkdocs.yml: hooks): pages whose text lives outside docs/, and the API
page's cross-references.

``proto/PROTOCOL.md`` (the protocol spec) and ``ARCHITECTURE.md`` (the one-page tour, at the
root where newcomers look) stay where they are and stay the only copy: this hook adds each to
the site as a generated page made from its file at build time, so nothing is copied into git.

A relative link in such a file is written for the file where it lives (``docs/security.md``
from ``ARCHITECTURE.md``); the page is served from ``docs/``, so each link that resolves
inside ``docs/`` is rewritten relative to the page. A link that leaves ``docs/`` is left as
it is, and the strict build reports it.

The docstrings cross-reference as Sphinx does (``:meth:`AsyncClient.submit```,
``:class:`~jaild.errors.Busy```, ``:attr:`lost <AsyncClient.lost>```), which mkdocstrings
shows verbatim. :func:`resolve_roles` turns each into the name it shows -- a link to its
entry where the page documents exactly one object of that name, plain code otherwise.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent

# page in the site <- file in the repository
PAGES = {
    "protocol.md": "proto/PROTOCOL.md",
    "architecture.md": "ARCHITECTURE.md",
}

LINK = re.compile(r"(\]\()([^)\s]+)(\))")


def rebase_links(text: str, source: str, page: str, docs_dir: str) -> str:
    """``text`` of the repository file ``source`` with its relative links rewritten for
    ``page`` (a path inside ``docs_dir``, the docs directory relative to the root)."""

    def rebase(match: re.Match[str]) -> str:
        target = match.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:|#|/", target):  # a URL, an anchor, an absolute path
            return match.group(0)
        path, hash_, anchor = target.partition("#")
        in_repo = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        if not in_repo.startswith(docs_dir + "/"):
            return match.group(0)
        in_docs = in_repo[len(docs_dir) + 1 :]
        new = posixpath.relpath(in_docs, posixpath.dirname(page) or ".")
        return f"{match.group(1)}{new}{hash_}{anchor}{match.group(3)}"

    return LINK.sub(rebase, text)


def on_files(files: Files, config: MkDocsConfig, **kwargs: Any) -> Files:
    docs_dir = Path(config.docs_dir).resolve().relative_to(ROOT).as_posix()
    for page, source in PAGES.items():
        text = (ROOT / source).read_text(encoding="utf-8")
        files.append(
            File.generated(config, page, content=rebase_links(text, source, page, docs_dir))
        )
    return files


ROLE = re.compile(
    r":(?:py:)?(?:meth|class|func|attr|mod|data|exc|obj):<code>(~?)([^<]*?)</code>"
)
IDS = re.compile(r'\bid="(jaild\.[A-Za-z0-9_.]+)"')


def resolve_roles(html: str) -> str:
    """``html`` with each Sphinx role rendered as the name it shows (``~a.b.C``: ``C``;
    ``text <target>``: ``text``), linked to the one entry of the page it names."""
    ids = set(IDS.findall(html))

    def entry(target: str) -> str | None:
        found = [i for i in ids if i == target or i.endswith("." + target)]
        return found[0] if len(found) == 1 else None

    def render(match: re.Match[str]) -> str:
        tilde, text = match.group(1), match.group(2).strip()
        shown, target = text, text
        named = re.fullmatch(r"(.*?)\s*&lt;([^&]+)&gt;", text)
        if named:
            shown, target = named.group(1), named.group(2)
        elif tilde:
            shown = text.rsplit(".", 1)[-1]
        anchor = entry(target.lstrip("~"))
        code = f"<code>{shown}</code>"
        return f'<a href="#{anchor}">{code}</a>' if anchor else code

    return ROLE.sub(render, html)


def on_page_content(html: str, **kwargs: Any) -> str:
    return resolve_roles(html)
