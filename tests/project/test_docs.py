"""The documentation (issue 72): the README stays what a newcomer reads first (under 200 lines,
the two commands in its opening), the site's home page is the README's text with its links
made relative to docs/, every page of docs/ is in the site's nav (make docs builds it strict),
and no file of the repository points outside it."""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_readme_is_short_and_the_site_home_is_its_text():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    opening = "\n".join(readme.splitlines()[:40])
    assert "make demo" in opening and "make test" in opening
    assert (ROOT / "docs" / "index.md").read_text() == readme.replace("](docs/", "](")
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link


def test_every_page_is_in_the_nav():
    nav = re.findall(r":\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages


def test_nothing_points_outside_the_repository():
    found = subprocess.run(["git", "grep", "-n", "-F", "-e", ".." + "/shared", "--", ".", ":!*.ipynb"],
                           cwd=ROOT, capture_output=True, text=True).stdout
    assert found == "", found
