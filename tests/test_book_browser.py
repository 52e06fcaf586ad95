"""The built book as a reader's browser shows it: every page built, every formula rendered offline by MathJax,
every internal link and asset present, every figure described, every chapter one click from Colab.

Needs `make book` (or `make test-book`) first, and Debian's chromium-headless-shell; `make test-browser` runs it
and says so when either is missing. The pages are opened from file:// URLs with networking disabled, so a formula
that renders here renders offline.
"""

import pathlib
import shutil
import subprocess
import urllib.parse

import pytest
import yaml
from bs4 import BeautifulSoup

ROOT = pathlib.Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
CHROMIUM = next(
    (shutil.which(name) for name in ("chromium-headless-shell", "chromium", "chromium-browser") if shutil.which(name)),
    None,
)
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (apt-get install chromium-headless-shell)"),
    pytest.mark.skipif(not (HTML / "index.html").exists(), reason="no built book (make book)"),
]

CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
TOC = yaml.safe_load((ROOT / "_toc.yml").read_text())
PAGES = [TOC["root"]] + [entry["file"] for part in TOC["parts"] for entry in part["chapters"]]
CHAPTERS = [p for p in PAGES if p.startswith("chapters/")]


def html_path(page):
    return HTML / f"{page}.html"


def source_soup(page):
    return BeautifulSoup(html_path(page).read_text(), "html.parser")


_DOM = {}


def rendered_dom(page):
    """The page's DOM after its scripts ran, as headless Chromium with no network dumps it."""
    if page not in _DOM:
        result = subprocess.run(
            [
                CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
                "--virtual-time-budget=20000", "--run-all-compositor-stages-before-draw",
                "--dump-dom", html_path(page).as_uri(),
            ],
            capture_output=True, text=True, timeout=120, check=False,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        _DOM[page] = BeautifulSoup(result.stdout, "html.parser")
    return _DOM[page]


def math_in_source(soup):
    """Math the HTML hands to MathJax: Sphinx wraps each formula in an element of class 'math'."""
    article = soup.select_one("article") or soup
    return [el for el in article.select(".math") if el.name in ("span", "div")]


@pytest.mark.parametrize("page", PAGES)
def test_page_is_built(page):
    assert html_path(page).is_file(), f"{page} is in _toc.yml but was not built"
    assert source_soup(page).select_one("article h1"), "page has no title"


@pytest.mark.parametrize("page", PAGES)
def test_every_formula_renders_offline(page):
    expected = len(math_in_source(source_soup(page)))
    dom = rendered_dom(page)
    article = dom.select_one("article") or dom
    rendered = article.select("mjx-container")
    errors = article.select("mjx-merror")
    assert not errors, f"MathJax errors: {[e.get('data-mjx-error') or e.get_text() for e in errors][:5]}"
    assert len(rendered) == expected, f"{len(rendered)} formulas rendered of {expected}"


def test_mathjax_is_served_by_the_book_itself():
    scripts = [s.get("src", "") for s in source_soup(PAGES[0]).select("script")]
    mathjax = [s for s in scripts if "mathjax" in s.lower() or "tex-" in s.lower()]
    assert mathjax, "no MathJax script on the page"
    for src in mathjax:
        assert not urllib.parse.urlparse(src).netloc, f"MathJax from the network: {src}"
        assert (html_path(PAGES[0]).parent / src.split("?")[0]).is_file(), f"missing {src}"


def internal_targets(page):
    soup = source_soup(page)
    here = html_path(page)
    for tag, attr in (("a", "href"), ("link", "href"), ("script", "src"), ("img", "src")):
        for el in soup.find_all(tag):
            url = el.get(attr)
            if not url or urllib.parse.urlparse(url).scheme or url.startswith(("//", "mailto:")):
                continue
            path, _, fragment = url.partition("#")
            target = (here.parent / urllib.parse.unquote(path.split("?")[0])).resolve() if path else here
            yield url, target, fragment


@pytest.mark.parametrize("page", PAGES)
def test_every_internal_link_and_asset_resolves(page):
    count = 0
    for url, target, fragment in internal_targets(page):
        count += 1
        if target.is_dir():
            target = target / "index.html"
        assert target.is_file(), f"{url} points to a missing file"
        if fragment and target.suffix == ".html":
            ids = {el.get("id") for el in BeautifulSoup(target.read_text(), "html.parser").find_all(id=True)}
            assert fragment in ids, f"{url}: no element with id {fragment!r}"
    assert count > 10


@pytest.mark.parametrize("page", PAGES)
def test_every_figure_has_alt_text(page):
    article = source_soup(page).select_one("article")
    images = article.find_all("img")
    for img in images:
        assert len((img.get("alt") or "").strip()) > 20, f"{img.get('src')} has no real alt text"


@pytest.mark.parametrize("page", CHAPTERS)
def test_chapter_has_its_colab_link(page):
    repo = urllib.parse.urlparse(CONFIG["repository"]["url"]).path.strip("/")
    branch = CONFIG["repository"]["branch"]
    book = CONFIG["repository"].get("path_to_book", "").strip("/")  # colab: the Colab edition of the chapters
    notebook = f"{book}/{page}.ipynb" if book else f"{page}.ipynb"
    assert (ROOT / notebook).is_file(), f"the Colab button would open {notebook}, which does not exist"
    expected = f"https://colab.research.google.com/github/{repo}/blob/{branch}/{notebook}"
    links = [a.get("href") for a in source_soup(page).find_all("a")]
    assert expected in links, f"no Colab link {expected}"


def summary():
    """What the checks above covered, counted from the built pages (printed after a run that passed)."""
    counts = {"pages": 0, "formulas": 0, "internal links and assets": 0, "figures with alt text": 0, "Colab links": 0}
    for page in PAGES:
        soup = source_soup(page)
        counts["pages"] += 1
        counts["formulas"] += len(math_in_source(soup))
        counts["internal links and assets"] += sum(1 for _ in internal_targets(page))
        counts["figures with alt text"] += len(soup.select_one("article").find_all("img"))
        counts["Colab links"] += any("colab.research.google.com" in (a.get("href") or "") for a in soup.find_all("a"))
    return counts
