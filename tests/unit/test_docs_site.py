"""The manual (mkdocs.yml, docs/) builds with warnings as errors, and the built HTML holds up: every page has a
title and a heading, each reference page has a table, and no internal link (page, file or #anchor) is broken."""
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from urllib.parse import unquote, urldefrag, urlparse

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
# pages a user looks things up in: each carries at least one table
REFERENCE_PAGES = ("getting-started", "porting", "verl_compat", "modes", "staleness", "features", "algorithms",
                   "engines", "rewards", "comparison", "planner", "multi-job", "ascend", "metrics", "reliability",
                   "measurements", "layout", "testing")


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.title, self.h1, self.tables, self.links, self.ids = "", 0, 0, [], set()
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        self._in_title = tag == "title"
        self.h1 += tag == "h1"
        self.tables += tag == "table"
        if tag in ("a", "link") and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag in ("img", "script") and attrs.get("src"):
            self.links.append(attrs["src"])

    def handle_data(self, data):
        if self._in_title:
            self.title += data

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f",
                           os.path.join(ROOT, "mkdocs.yml"), "-d", str(out)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, ("mkdocs build --strict failed (install the test extra: pip install -e '.[test]')\n"
                                  + proc.stdout[-3000:] + proc.stderr[-3000:])
    pages = {}
    for dirpath, _, files in os.walk(out):
        for name in files:
            if name.endswith(".html") and name != "404.html":
                path = os.path.join(dirpath, name)
                page = Page()
                with open(path, encoding="utf-8") as fh:
                    page.feed(fh.read())
                pages[os.path.relpath(path, out)] = page
    return str(out), pages


def test_every_page_has_a_title_and_a_heading(site):
    _, pages = site
    assert len(pages) >= len(REFERENCE_PAGES) + 2, sorted(pages)
    for rel, page in pages.items():
        assert page.title.strip() and page.title.strip() != "fully_async" or rel == "index.html", rel
        assert page.h1 >= 1, f"{rel}: no <h1>"


def test_each_reference_page_has_a_table(site):
    _, pages = site
    for name in REFERENCE_PAGES:
        rel = os.path.join(name, "index.html")
        assert rel in pages, f"{name}.md is not in the site"
        assert pages[rel].tables >= 1, f"{name}: no table"


def test_no_internal_link_is_broken(site):
    out, pages = site
    checked, broken = 0, []
    for rel, page in pages.items():
        base = os.path.dirname(os.path.join(out, rel))
        for href in page.links:
            if urlparse(href).scheme or href.startswith(("//", "mailto:")):
                continue
            target, anchor = urldefrag(href)
            path = os.path.normpath(os.path.join(base, unquote(target))) if target else os.path.join(out, rel)
            if os.path.isdir(path):
                path = os.path.join(path, "index.html")
            checked += 1
            if not os.path.exists(path):
                broken.append(f"{rel}: {href}")
            elif anchor and path.endswith(".html"):
                key = os.path.relpath(path, out)
                if key in pages and anchor not in pages[key].ids:
                    broken.append(f"{rel}: {href} (no #{anchor})")
    assert checked > 100, checked
    assert not broken, broken


def test_the_readme_links_into_pages_that_exist():
    readme = open(os.path.join(ROOT, "README.md")).read()
    targets = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert len(targets) >= 10, targets
    missing = [t for t in targets if not os.path.exists(os.path.join(ROOT, t))]
    assert not missing, missing


def test_the_site_folder_is_git_ignored():
    ignored = subprocess.run(["git", "check-ignore", "-q", "site/index.html"], cwd=ROOT)
    assert ignored.returncode == 0, "mkdocs' site_dir (site/) must be in .gitignore"
