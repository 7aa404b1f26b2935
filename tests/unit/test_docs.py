"""The docs: the MkDocs site builds strictly, and the README stays short with links that work.

The site is built into a temporary directory, never inside the checkout. ``mkdocs.yml``'s
``validation`` makes a broken link, an unrecognized link or a missing anchor a warning and
``--strict`` makes every warning an error, so each of them fails this test; mkdocstrings'
warnings (an API reference that does not resolve, a docstring that does not parse) do too.
The README and the changelog are outside the site: their relative links (and the anchors of
the Markdown files they name) are checked here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 350


def _mkdocs_build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
    except ImportError:
        pytest.fail("MkDocs is not installed: pip install -e '.[docs]' (make setup installs it)")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )


def test_the_site_builds_strictly_outside_the_checkout(tmp_path: Path) -> None:
    before = {p for p in (REPO / "site", REPO / "docs/__pycache__") if p.exists()}
    site = tmp_path / "site"
    done = _mkdocs_build(REPO / "mkdocs.yml", site, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    # the pages that are not files in docs/: the hook's and the API's
    assert "version 5" in (site / "protocol/index.html").read_text(encoding="utf-8")
    assert "The path of a job" in (site / "architecture/index.html").read_text(encoding="utf-8")
    api = (site / "api/index.html").read_text(encoding="utf-8")
    for name in ["jaild.client.Client", "jaild.client.AsyncClient", "jaild.client.JobResult",
                 "jaild.client.Session", "jaild.errors", "jaild.testing"]:
        assert f'id="{name}"' in api, name
    # the docstrings' Sphinx roles, rendered as the names they show, linked where the page
    # documents the one object they name (docs/hooks.py: resolve_roles)
    assert not re.search(r":(meth|class|func|attr|mod|data|exc):<code>", api), "a raw role"
    assert '<a href="#jaild.client.AsyncClient.submit"><code>AsyncClient.submit</code></a>' in api
    assert not (site / "hooks.py").exists()
    after = {p for p in (REPO / "site", REPO / "docs/__pycache__") if p.exists()}
    assert after == before, f"the build left {after - before} in the checkout"


def test_the_strict_build_fails_on_a_missing_anchor(tmp_path: Path) -> None:
    """The control: mkdocs.yml's validation settings, on a two-page site whose one link names
    an anchor the other page lacks, fail the build (and pass once the anchor is there)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with MkDocs: pip install -e '.[docs]'")
    validation = yaml.safe_load((REPO / "mkdocs.yml").read_text())["validation"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#a-section)\n")
    (docs / "other.md").write_text("# Other\n\n## Another section\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump({"site_name": "t", "docs_dir": "docs",
                                      "validation": validation}))
    broken = _mkdocs_build(config, tmp_path / "site", cwd=tmp_path)
    assert broken.returncode != 0 and "a-section" in broken.stderr, broken.stderr
    (docs / "other.md").write_text("# Other\n\n## A section\n")
    assert _mkdocs_build(config, tmp_path / "site", cwd=tmp_path).returncode == 0


def test_the_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail to docs/"
    )


def _github_anchor(heading: str) -> str:
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _links(text: str) -> list[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", text)  # not in code blocks
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_relative_links_outside_the_site_point_at_files(name: str) -> None:
    path = REPO / name
    text = path.read_text(encoding="utf-8")
    headings = {_github_anchor(h) for h in re.findall(r"(?m)^#+ (.*)$", text)}
    checked = 0
    for target in _links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        if not file:
            assert anchor in headings, f"{name}: no heading for the link #{anchor}"
            continue
        assert (path.parent / file).exists(), f"{name}: the link {target} points at nothing"
        if anchor and file.endswith(".md"):
            theirs = (path.parent / file).read_text(encoding="utf-8")
            assert anchor in {_github_anchor(h) for h in re.findall(r"(?m)^#+ (.*)$", theirs)}, (
                f"{name}: {file} has no heading for the link {target}"
            )
        checked += 1
    assert checked, f"{name}: no relative link found (the check would prove nothing)"


def test_a_role_shows_its_name_and_links_only_an_object_the_page_names_once() -> None:
    sys.path.insert(0, str(REPO / "docs"))
    try:
        from hooks import resolve_roles
    finally:
        sys.path.pop(0)
    page = ('<h3 id="jaild.client.Client"></h3><h3 id="jaild.client.Client.run"></h3>'
            '<h3 id="jaild.fleet.Fleet.run"></h3>')
    assert resolve_roles(page + ":class:<code>~jaild.client.Client</code>").endswith(
        '<a href="#jaild.client.Client"><code>Client</code></a>')
    assert resolve_roles(page + ":meth:<code>its run &lt;Client.run&gt;</code>").endswith(
        '<a href="#jaild.client.Client.run"><code>its run</code></a>')
    # two objects end in ".run": the name alone links neither
    assert resolve_roles(page + ":meth:<code>run</code>").endswith("<code>run</code>")
    assert resolve_roles(":mod:<code>jaild.loops</code>") == "<code>jaild.loops</code>"


def test_the_errors_page_lists_every_error_as_the_code_does() -> None:
    from jaild.errors import ERROR_CLASSES, reference_markdown

    page = (REPO / "docs/using/errors.md").read_text(encoding="utf-8")
    assert reference_markdown() in page, "run: python scripts/update_doc_references.py"
    for code, cls in ERROR_CLASSES.items():  # every wire code, with its class's meaning
        row = next(line for line in page.splitlines() if f"`{code}`" in line)
        assert cls.__name__ in row and not row.endswith("|  |"), row
