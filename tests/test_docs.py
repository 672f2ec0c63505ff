"""The documentation cannot rot: docs/ builds with `mkdocs build --strict` (broken links and anchors between pages
fail, mkdocs.yml's `validation:` makes them warnings and strict makes warnings errors), every page in docs/ is in
mkdocs.yml's nav, and every relative link in README.md points at an existing file (and heading)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import mkdocs  # noqa: F401  (in the [dev] extra: a missing mkdocs is a failure, not a skip)
import yaml

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title"); images excluded
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def markdown_links(text: str) -> list[str]:
    """Link targets of a Markdown text, outside fenced code blocks and code spans."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return LINK.findall(text)


def heading_slugs(text: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation other than '-' and '_' removed,
    spaces -> '-', repeats numbered -1, -2, ..."""
    slugs: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        slug, n = base, 0
        while slug in slugs:
            n += 1
            slug = f"{base}-{n}"
        slugs.add(slug)
    return slugs


def broken_links(md_file: Path) -> list[str]:
    """Relative links of `md_file` whose file (or heading anchor in a Markdown file) does not exist."""
    problems = []
    text = md_file.read_text()
    for target in markdown_links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (md_file.parent / unquote(path_part)).resolve() if path_part else md_file
        if not dest.exists():
            problems.append(f"{target}: {dest} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in heading_slugs(dest.read_text()):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def nav_pages(nav) -> list[str]:
    """Every page file named in an mkdocs `nav:` (nested sections included)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in nav_pages(v)]
    return []


def test_link_and_slug_helpers_catch_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## What `make demo` does (CPU)\n\n```\n# not a heading\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text(
        "[ok](docs/a.md) [ok anchor](docs/a.md#what-make-demo-does-cpu) [web](https://example.org/x.md)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#not-a-heading) ![img](missing.png) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(readme) == [
        f"docs/b.md: {tmp_path / 'docs' / 'b.md'} does not exist",
        "docs/a.md#not-a-heading: no heading with anchor #not-a-heading in a.md",
    ]
    assert nav_pages([{"Home": "index.md"}, {"Recipes": [{"X": "x.md"}, "y.md"]}]) == ["index.md", "x.md", "y.md"]


def test_readme_relative_links_resolve():
    assert broken_links(ROOT / "README.md") == []


def test_readme_is_short_and_links_every_docs_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200, "README.md is the front page: move details into docs/"
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in markdown_links(text) if t.startswith("docs/")}
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked)
    assert missing == [], f"docs pages not linked from README.md: {missing}"


def test_every_docs_page_is_in_mkdocs_nav():
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = nav_pages(cfg["nav"])
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(set(nav)) == pages, f"nav vs docs/: missing {sorted(set(pages) - set(nav))}, " \
                                      f"unknown {sorted(set(nav) - set(pages))}"
    assert len(nav) == len(set(nav)), "a page is listed twice in nav"
    assert cfg.get("strict") is True


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-4000:]
    for page in nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]):
        out = site / ("index.html" if page == "index.md" else page[:-3] + "/index.html")
        assert out.is_file(), f"{page} was not built"


def test_mkdocs_strict_fails_on_a_broken_anchor(tmp_path):
    """The strict build is not a formality: a copy of the docs with one broken cross-page anchor fails."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for p in (ROOT / "docs").glob("*.md"):
        (docs / p.name).write_text(p.read_text())
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](scaling.md#no-such-heading)\n")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no-such-heading" in proc.stderr, proc.stderr[-2000:]
