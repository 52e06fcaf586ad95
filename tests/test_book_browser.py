"""The built book as a reader's browser shows it: every page built, every formula rendered offline by MathJax,
every internal link and asset present, every figure described, every chapter one click from Colab; on a 400 px
phone the menu and the contents open, printed tables keep their lines, nothing scrolls sideways but a table with its
cue, no formula is wider than the column, "Back to top" covers no text, wrapped code keeps its indentation and
the interactive figures fit the column; at 1,400 px no code cell or output scrolls sideways; no page shows raw TeX;
axe-core finds no serious or critical accessibility violation on any page, light or dark, desktop or phone, and
every fold is named for what it opens;
every interactive figure draws from the book's own copy of Vega, carries a label that stays true, follows the dark
theme (a dark card, light text, controls drawn in the card's scheme), keeps its controls and its picture on one
phone screen, shows its first frame and caption without scripts, and moves when its control is used from the
keyboard.

Needs `make book` (or `make test-book`) first, and Debian's chromium-headless-shell; `make test-browser` runs it
and says so when either is missing. The accessibility audit needs axe-core from npm (`npm ci`, which `make test`
runs where npm is present) and is skipped, saying so, without it. The layout tests drive that Chromium with Playwright (no browser download:
`executable_path` points at Debian's binary). The pages are opened from file:// URLs with networking disabled, so
a formula that renders here renders offline.
"""

import functools
import json
import pathlib
import re
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
try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
except ImportError:  # the file:// checks above still run; the layout tests below skip
    sync_playwright, PlaywrightTimeout = None, TimeoutError
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium (apt-get install chromium-headless-shell)"),
    pytest.mark.skipif(not (HTML / "index.html").exists(), reason="no built book (make book)"),
]

CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
TOC = yaml.safe_load((ROOT / "_toc.yml").read_text())
PAGES = [TOC["root"]] + [entry["file"] for part in TOC["parts"] for entry in part["chapters"]]
CHAPTERS = [p for p in PAGES if p.startswith("chapters/")]
NOTEBOOK_PAGES = [p for p in PAGES if p.startswith(("chapters/", "guide/"))]
# An interactive figure (lib/interactive.py) is found by its markup: the class of the snippet's wrapper, in the
# chapter's stored outputs and on its built page. Which chapters hold one is not written down here.
INTERACTIVE_MARK = "sdpa-interactive"
VEGA_BUNDLE = "vega-bundle"  # tools/interactive_figures.py serves Vega as _static/interactive/vega-bundle.js


def interactive_in_notebook(page):
    """How many interactive figures the page's notebook stores among its outputs."""
    path = ROOT / f"{page}.ipynb"
    if not path.is_file():
        return 0
    outputs = [o for c in json.loads(path.read_text())["cells"] for o in c.get("outputs", [])]
    return sum(INTERACTIVE_MARK in "".join(o.get("data", {}).get("text/html", "")) for o in outputs)


INTERACTIVE = [p for p in CHAPTERS if interactive_in_notebook(p)]


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


@functools.cache
def ids_in(path):
    """Every element id of a built page (parsed once: the chapters link to each other hundreds of times)."""
    return frozenset(el.get("id") for el in BeautifulSoup(path.read_text(), "html.parser").find_all(id=True))


@pytest.mark.parametrize("page", PAGES)
def test_every_internal_link_and_asset_resolves(page):
    count = 0
    for url, target, fragment in internal_targets(page):
        count += 1
        if target.is_dir():
            target = target / "index.html"
        assert target.is_file(), f"{url} points to a missing file"
        if fragment and target.suffix == ".html":
            assert fragment in ids_in(target), f"{url}: no element with id {fragment!r}"
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


@pytest.mark.parametrize("page", PAGES)
def test_each_inline_script_once(page):
    """A second copy of sphinx-thebe's `const THEBE_JS_URL` is a SyntaxError (tools/script_once.py removes it)."""
    bodies = [s.get_text() for s in source_soup(page).find_all("script") if not s.get("src") and s.get_text().strip()]
    twice = sorted({b[:60] for b in bodies if bodies.count(b) > 1})
    assert not twice, f"inline scripts on the page twice: {twice}"


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_every_fold_says_what_it_holds(page):
    """A fold's prompt names its content ("Show solution", "Show the checks"), from the cell's role tag."""
    prompts = [p.get_text(strip=True) for p in source_soup(page).select("article details summary p.collapsed")]
    generic = [p for p in prompts if p.startswith("Show code cell")]
    assert not generic, f"{len(generic)} of {len(prompts)} folds say {generic[0]!r} (tag the cell with its role)"


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_every_cell_fold_is_named_for_what_it_opens(page):
    """A cell's fold takes its name from the prompt it shows (tools/accessible_names.py), not the generic "Toggle
    hidden content"; a check's fold adds the line it folds above, for a screen reader: "Show the checks: ✓ 3 ..."."""
    article = source_soup(page).select_one("article")
    summaries = article.select("div.cell details.hide > summary")
    assert summaries, "no fold on the page"
    generic = [summary for summary in summaries if summary.get("aria-label")]
    assert not generic, f"{len(generic)} of {len(summaries)} folds named by an aria-label, not by what they show"
    for summary in summaries:
        shown = summary.select_one("p.collapsed").get_text(" ", strip=True)
        assert "show" in shown.lower() and not shown.startswith("Show code cell"), f"a fold says {shown!r}"
    for cell in article.select("div.cell.tag_check"):
        summary, line = cell.select_one("details.hide > summary"), cell.select_one("div.cell_output pre")
        if summary and line:
            said = summary.select_one("p.collapsed .visually-hidden").get_text(strip=True)
            assert said == ": " + line.get_text().strip().splitlines()[0], f"a check's fold says {said!r}"


FOLD_BUTTONS = """() => [...document.querySelectorAll("article .admonition-title > button.toggle-button")]
  .map((button) => [button.getAttribute("aria-label"), button.parentElement.textContent.replace(/\\s+/g, " ").trim()])"""


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_every_dropdown_button_is_named_for_its_title(browser, page):
    """sphinx-togglebutton's script names each dropdown's button "Toggle hidden content"; _static/book.js names it
    after the aside's or the solution's title."""
    buttons = desktop(browser, page)["fold_buttons"]
    wrong = [(label, title) for label, title in buttons if label != title or label == "Toggle hidden content"]
    assert not wrong, f"{len(wrong)} of {len(buttons)} dropdown buttons are not named for their title, first {wrong[:2]}"


def test_landing_page_map_shows_the_reading_times_of_the_notebooks_as_they_are_now():
    """A build older than a chapter's last change shows stale minutes: the map must match the notebooks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chapter_map", ROOT / "tools" / "chapter_map.py")
    chapter_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter_map)
    boxes = source_soup(PAGES[0]).select("figure.chapter-map svg a[data-chapter]")
    shown = {a["data-chapter"]: (a["href"], a["data-minutes"]) for a in boxes}
    for page in NOTEBOOK_PAGES:
        key = page.split("/")[-1][:2] if page.startswith("chapters/") else "guide"
        key = key.lstrip("0")
        notebook = json.loads((ROOT / f"{page}.ipynb").read_text())
        assert key in shown, f"the chapter map has no link to {page}"
        assert shown[key] == (f"{page}.html", str(chapter_map.reading_minutes(notebook))), page


# ------------------------------------------------------------------------------------ the layout, in Playwright
#
# Each page is loaded once per view (desktop, phone, dark) and measured by every probe of that view in one go:
# PROBES maps a view to {name: JavaScript run on the page}, in order (a probe that opens the folds comes last).
# A new check of the layout adds a probe here and a test that reads visit(browser, page, view)[name].

DESKTOP = {"width": 1400, "height": 900}
PHONE = {"width": 400, "height": 800}


@pytest.fixture(scope="module")
def browser():
    if sync_playwright is None:
        pytest.skip("Playwright is not installed (it is in requirements.txt: make installs it)")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


def open_page(browser, page, viewport, phone=False, mode=None):
    """A new tab showing the page as on a first visit (nothing stored), its scripts run and its formulas typeset,
    offline. Script errors are collected in tab.errors, messages the console shows as errors in tab.console_errors;
    mode "dark" or "light" is the reader's choice of colours stored before the page loads. Every URL the page asks
    for is kept in tab.requests; one outside the book's folder (the network, or a file beside the build) is refused
    and also kept in tab.outside."""
    context = browser.new_context(viewport=viewport, is_mobile=phone, has_touch=phone)
    requests, outside, inside = [], [], HTML.as_uri() + "/"

    def only_the_book(route):
        url = route.request.url
        requests.append(url)
        if url.startswith(inside):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    context.route(re.compile(".*"), only_the_book)
    if mode:
        context.add_init_script(f"localStorage.setItem('mode', '{mode}'); localStorage.setItem('theme', '{mode}');")
    tab = context.new_page()
    tab.errors, tab.console_errors, tab.requests, tab.outside = [], [], requests, outside
    tab.on("pageerror", lambda error: tab.errors.append(str(error)))
    tab.on("console", lambda message: message.type == "error" and tab.console_errors.append(message.text))
    tab.goto(html_path(page).as_uri(), wait_until="load")
    if tab.evaluate("() => !!document.querySelector('script[src*=\"mathjax\"]')"):
        tab.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=30_000)
        tab.evaluate("() => MathJax.startup.promise.then(() => true)")
    return tab


ON_SCREEN = """(selector) => [...document.querySelectorAll(selector)].filter((el) => {
  const box = el.getBoundingClientRect(), style = getComputedStyle(el);
  return box.width > 0 && box.height > 0 && style.visibility === "visible" && Number(style.opacity) > 0
    && box.right > 0 && box.left < innerWidth;  // a long list may run below the screen, never beside it
}).length"""


def on_screen(tab, selector):
    """How many elements matching selector a reader can see or scroll to: laid out, not hidden, not off to a side."""
    return tab.evaluate(ON_SCREEN, selector)


def tap_visible(tab, selector, index=0):
    buttons = tab.locator(selector)
    shown = [i for i in range(buttons.count()) if buttons.nth(i).is_visible()]
    assert len(shown) > index, f"no visible {selector} at {tab.viewport_size['width']} px"
    buttons.nth(shown[index]).tap()
    tab.wait_for_timeout(500)


# What a reader reads as prose: the article without code, outputs and typeset formulas.
PROSE = """() => {
  const article = (document.querySelector("article") || document.body).cloneNode(true);
  article.querySelectorAll("mjx-container, pre, code, .cell_input, .cell_output, script, style")
    .forEach((el) => el.remove());
  return article.textContent;
}"""
RAW_TEX = re.compile(r"\$|\\[A-Za-z]{2,}|[_^]\{")
MATHJAX_ERRORS = """() => [...document.querySelectorAll("article mjx-merror")]
  .map((e) => e.getAttribute("data-mjx-error") || e.textContent)"""

# The toggles a reader opens a fold with: a cell's fold (checks, plotting code, solutions, an aside's code on its
# own) and a dropdown aside's title. Those inside a closed fold are not laid out and are left out.
TOGGLES = "article div.cell details.hide > summary, article div.dropdown.admonition > .admonition-title"
FOLD_STYLES = """(selector) => [...document.querySelectorAll(selector)]
  .filter((toggle) => toggle.getBoundingClientRect().height > 0)
  .map((toggle) => {
    const title = toggle.matches("summary") ? toggle.querySelector("p.admonition-title") : toggle;
    const shown = [toggle, title].map((el) => getComputedStyle(el));
    return {
      check: !!toggle.closest("div.cell.tag_check"),
      background: shown[0].backgroundColor,
      weight: shown[1].fontWeight,
      triangle: shown.some((style) => style.display === "list-item" && style.listStyleType !== "none"),
      text: title.textContent.trim().slice(0, 40),
    };
  })"""
TOGGLE_HEIGHTS = """(selector) => [...document.querySelectorAll(selector)]
  .map((toggle) => [toggle.getBoundingClientRect().height, toggle.textContent.trim().slice(0, 40)])
  .filter(([height]) => height > 0)"""

# The contrast (WCAG 2) of each "✓ N checks" line against the background it is drawn on.
CHECK_CONTRAST = """() => {
  const rgba = (text) => (text.match(/[\\d.]+/g) || []).map(Number);
  const luminance = ([r, g, b]) => {
    const f = (c) => ((c /= 255) <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4);
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const background = (el) => {
    for (; el; el = el.parentElement) {
      const colour = rgba(getComputedStyle(el).backgroundColor);
      if (colour.length === 3 || colour[3] > 0.5) return colour;
    }
    return [255, 255, 255];
  };
  return [...document.querySelectorAll("article div.cell.tag_check div.cell_output pre")].slice(0, 30)
    .map((pre) => {
      const [a, b] = [luminance(rgba(getComputedStyle(pre).color)), luminance(background(pre))];
      return [(Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05), pre.textContent.trim().slice(0, 40)];
    });
}"""

# Every fold opened (checks, solutions, asides), then, a frame later (the page fits what a fold shows when it
# opens: _static/book.js), each code block, output, formula and Markdown table measured in the real layout. An
# output that scrolls is a table (class output-table: it keeps its lines) or not; one that scrolls shows its cue
# (custom.css draws a shadow in its background; a Markdown table's box fades out at its right edge).
SIDEWAYS = """async () => {
  document.querySelectorAll("details").forEach((d) => { d.open = true; });
  document.querySelectorAll(".toggle-hidden").forEach((e) => e.classList.remove("toggle-hidden"));
  for (let i = 0; i < 3; i++) await new Promise((done) => requestAnimationFrame(done));
  const article = document.querySelector("article") || document.body;
  const wide = (el) => el.scrollWidth > el.clientWidth + 1;
  const first = (el) => (el.innerText || "").trim().split("\\n")[0].slice(0, 60);
  const code = [], outputs = [], tables = [];
  article.querySelectorAll("pre").forEach((pre) => {
    if (!wide(pre)) return;
    if (!pre.closest(".cell_output")) code.push(first(pre));
    else if (pre.classList.contains("output-table")) {
      tables.push({text: first(pre), cue: getComputedStyle(pre).backgroundImage.includes("gradient")});
    } else outputs.push(first(pre));
  });
  article.querySelectorAll(".cell_output > .output").forEach((out) => {
    if (wide(out) && !out.querySelector("pre")) outputs.push(first(out) || "(an output)");
  });
  const formulas = [...article.querySelectorAll("div.math, mjx-container[display='true']")].filter(wide).length;
  const markdown = [...article.querySelectorAll(".pst-scrollable-table-container")].filter(wide).map((box) => ({
    text: first(box), cue: getComputedStyle(box).maskImage.includes("gradient"),
  }));
  return {code, outputs, tables, formulas, markdown};
}"""

# On a phone (after SIDEWAYS opened every fold): printed tables whose lines wrap (their columns scrambled),
# and wrapped lines of code that continue left of their own indentation (_static/book.js and custom.css give each
# a hanging indent, at most 35vw). A line's visual lines are the distinct tops of its text's boxes.
PHONE_LINES = """() => {
  const article = document.querySelector("article") || document.body;
  const rows = (node) => {
    const range = document.createRange();
    range.selectNodeContents(node);
    const boxes = [...range.getClientRects()].filter((box) => box.width > 0).sort((a, b) => a.top - b.top);
    const found = [];
    boxes.forEach((box) => {
      const last = found[found.length - 1];
      if (last && box.top - last.top < box.height / 2) last.left = Math.min(last.left, box.left);
      else found.push({top: box.top, left: box.left});
    });
    return found;
  };
  const shown = (el) => el.getBoundingClientRect().height > 0;
  const first = (el) => el.textContent.trim().split("\\n")[0].slice(0, 60);
  const lines = (text) => text.replace(/\\n$/, "").split("\\n").filter((line) => line.length).length;
  const wrapped = [], lost = [];
  let hung = 0;
  article.querySelectorAll(".cell_output pre:not(.output-wraps)").forEach((pre) => {
    if (shown(pre) && rows(pre).length > lines(pre.textContent)) wrapped.push(first(pre));
  });
  article.querySelectorAll(".cell_input pre, div.highlight pre").forEach((pre) => {
    if (pre.closest(".cell_output") || !shown(pre)) return;
    const units = [...pre.querySelectorAll("span.code-line")];
    if (!units.length) {
      if (rows(pre).length > lines(pre.textContent)) lost.push(first(pre) + " (no line spans)");
      return;
    }
    const probe = document.createElement("span");
    probe.textContent = "0".repeat(20);
    pre.appendChild(probe);
    const column = probe.getBoundingClientRect().width / 20;
    probe.remove();
    units.forEach((line) => {
      const found = rows(line);
      if (found.length < 2) return;
      const indent = line.textContent.match(/^ */)[0].length;
      const start = found[0].left, next = Math.min(...found.slice(1).map((row) => row.left));
      const room = Math.min((indent + 1) * column, 0.35 * innerWidth);  // custom.css caps the indent at 35vw
      if (next < start + room - 1) lost.push(line.textContent.trim().slice(0, 60));
      else hung += 1;
    });
  });
  return {wrapped, lost, hung};
}"""

# On a phone, each interactive figure once drawn: its picture against the column (right edges, and the scale at
# which custom.css draws it: the width drawn over the width Vega laid out), and its controls' right edges.
FIGURES_ON_A_PHONE = """(mark) => [...document.querySelectorAll("." + mark)].map((figure) => {
  const column = figure.getBoundingClientRect(), svg = figure.querySelector(".vega-embed > svg");
  if (!svg) return {drawn: false};
  const box = svg.getBoundingClientRect(), embed = figure.querySelector(".vega-embed");
  return {
    drawn: true, column: column.right, right: box.right, scale: box.width / svg.viewBox.baseVal.width,
    scrolls: embed.scrollWidth > embed.clientWidth + 1,
    controls: [...figure.querySelectorAll(".vega-bind input")].map((el) => el.getBoundingClientRect().right),
  };
})"""


def once_drawn(script):
    """A probe that waits for each figure of the page to be drawn (up to the first that is not), then runs script."""

    def probe(tab):
        figures = tab.locator(f".{INTERACTIVE_MARK}")
        for n in range(figures.count()):
            try:
                figures.nth(n).locator(".vega-embed > svg").first.wait_for(timeout=20_000)
            except PlaywrightTimeout:
                break
        return tab.evaluate(script, INTERACTIVE_MARK)

    return probe


figures_on_a_phone = once_drawn(FIGURES_ON_A_PHONE)


# In dark mode, each figure control's colour scheme and accent, and the brightness of the box it is drawn on.
CONTROL_COLOURS = """(mark) => {
  const rgba = (text) => (text.match(/[\\d.]+/g) || []).map(Number);
  const behind = (el) => {
    for (; el; el = el.parentElement) {
      const colour = rgba(getComputedStyle(el).backgroundColor);
      if (colour.length === 3 || colour[3] > 0.5) return colour;
    }
    return [255, 255, 255];
  };
  return [...document.querySelectorAll("." + mark + " .vega-bind input")].map((input) => {
    const style = getComputedStyle(input), [r, g, b] = behind(input);
    return {kind: input.type, scheme: style.colorScheme, accent: style.accentColor,
            light: (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255 > 0.5};
  });
}"""


# In dark mode, each drawn figure: the brightness of its card (the first opaque background behind its picture) and
# of its axis labels and titles, and the SVG's own background.
FIGURE_COLOURS = """(mark) => {
  const rgba = (text) => (text.match(/[\\d.]+/g) || []).map(Number);
  const light = ([r, g, b]) => (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255;
  const behind = (el) => {
    for (; el; el = el.parentElement) {
      const colour = rgba(getComputedStyle(el).backgroundColor);
      if (colour.length === 3 || colour[3] > 0.5) return colour;
    }
    return [255, 255, 255];
  };
  return [...document.querySelectorAll("." + mark)].map((figure) => {
    const svg = figure.querySelector(".vega-embed > svg");
    if (!svg) return {drawn: false};
    const labels = [...svg.querySelectorAll(".role-axis-label text, .role-axis-title text, .role-title-text text")];
    return {drawn: true, card: light(behind(svg.parentElement)),
            text: labels.map((t) => light(rgba(getComputedStyle(t).fill))),
            background: svg.querySelector(".background") ? svg.querySelector(".background").getAttribute("fill") : null};
  });
}"""


figure_colours = once_drawn(FIGURE_COLOURS)


# The interactive figures (lib/interactive.py): whether Vega came from the book's own bundle, and then each figure
# drawn, its first control focused and operated from the keyboard, and its picture compared before and after.
VEGA_ON_THE_PAGE = """(bundle) => ({
  embed: typeof window.vegaEmbed === "function",
  scripts: [...document.querySelectorAll("script[src]")].map((s) => s.src).filter((src) => src.includes(bundle)),
})"""


# A focused slider: the room between the right edge of its focus ring and the value printed after it (negative:
# the ring covers the value).
RING_GAP = """(el) => {
  const style = getComputedStyle(el), box = el.getBoundingClientRect(), value = el.nextElementSibling;
  const ring = style.outlineStyle === "none" ? 0 : parseFloat(style.outlineWidth) + parseFloat(style.outlineOffset);
  return value ? value.getBoundingClientRect().left - (box.right + Math.max(ring, 0)) : null;
}"""


def operate_the_figures(tab):
    """Each figure on the page drawn (an SVG inside it), then its first control used as a keyboard reader would:
    Space ticks a checkbox; an arrow moves a slider or the chosen radio button (the other arrow where the first
    finds the control at its end). Returns, per figure, its label, whether it drew, the control's kind and label,
    and whether the picture changed."""
    figures, found = tab.locator(f".{INTERACTIVE_MARK}"), []
    for n in range(figures.count()):
        figure = figures.nth(n)
        picture = figure.locator("svg").first
        control = figure.locator(".vega-bind input").first
        label = figure.get_attribute("aria-label") or ""
        try:  # a page whose Vega never came draws nothing: the next figures get 2 s, not 20 each
            picture.wait_for(timeout=20_000 if all(f["drawn"] for f in found) else 2_000)
            control.wait_for(timeout=2_000)
        except PlaywrightTimeout as error:
            found.append({"label": label, "drawn": False, "error": str(error).splitlines()[0]})
            continue
        kind = control.get_attribute("type")
        if kind == "radio":  # the arrows move from the chosen option
            control = figure.locator(".vega-bind input[type=radio]:checked").first
        labelled = control.evaluate("(el) => [...el.labels].map((l) => l.textContent.trim()).join(' ')")
        before, changed = picture.inner_html(), False
        for key in ["Space"] if kind == "checkbox" else ["ArrowRight", "ArrowLeft"]:
            control.focus()
            tab.keyboard.press(key)
            tab.wait_for_timeout(400)
            if picture.inner_html() != before:
                changed = True
                break
        found.append({"label": label, "drawn": True, "control": kind, "control_label": labelled,
                      "focused": control.evaluate("(el) => el === document.activeElement"), "changed": changed,
                      "ring_gap": control.evaluate(RING_GAP) if kind == "range" else None})
    return found


# The accessibility audit: axe-core, from npm (package.json pins it; `make test` runs `npm ci`), read from
# node_modules and put into the page by Playwright, so nothing is fetched while the test runs. Every fold is opened
# first, so what they hold is audited too. WCAG 2.0, 2.1 and 2.2, levels A and AA; the serious and critical
# violations, each with its rule, its count and the first elements it names.
AXE = ROOT / "node_modules" / "axe-core" / "axe.min.js"
AXE_TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "wcag22aa"]  # (axe has no wcag22a: 2.2 added AA rules)
AXE_RUN = """async (tags) => {
  document.querySelectorAll("details").forEach((d) => { d.open = true; });
  document.querySelectorAll(".toggle-hidden").forEach((e) => e.classList.remove("toggle-hidden"));
  for (let i = 0; i < 3; i++) await new Promise((done) => requestAnimationFrame(done));
  // an opened fold fades in (myst-nb, 0.3 s): its text is measured once it is drawn in its own colours
  const finite = document.getAnimations().filter((a) => a.effect && a.effect.getComputedTiming().iterations !== Infinity);
  await Promise.all(finite.map((a) => a.finished.catch(() => null)));
  // preload: false, since axe's fetch of the style sheets, refused from file:// pages, logs console errors
  const options = {runOnly: {type: "tag", values: tags}, resultTypes: ["violations"], preload: false};
  const result = await axe.run(document, options);
  return {
    theme: document.documentElement.dataset.theme,
    version: axe.version,
    violations: result.violations.filter((v) => ["serious", "critical"].includes(v.impact)).map((v) => ({
      rule: v.id, impact: v.impact, help: v.help, count: v.nodes.length,
      elements: v.nodes.slice(0, 3).map((n) => n.target.join(" ") + " " + n.html.slice(0, 80)),
    })),
  };
}"""


def audit(tab):
    """axe-core's serious and critical violations on the page as loaded, or None where npm did not install it."""
    if not AXE.is_file():
        return None
    tab.add_script_tag(path=str(AXE))
    return tab.evaluate(AXE_RUN, AXE_TAGS)


VIEWS = {"desktop": (DESKTOP, False, None), "phone": (PHONE, True, None), "dark": (DESKTOP, False, "dark"),
         "phone-dark": (PHONE, True, "dark"), "interactive": (DESKTOP, False, None)}
PROBES = {
    "desktop": {"mathjax_errors": MATHJAX_ERRORS, "prose": PROSE, "folds": (FOLD_STYLES, TOGGLES),
                "check_contrast": CHECK_CONTRAST, "fold_buttons": FOLD_BUTTONS, "sideways": SIDEWAYS, "axe": audit},
    "phone": {"page_width": "() => document.documentElement.scrollWidth", "toggle_heights": (TOGGLE_HEIGHTS, TOGGLES),
              "sideways": SIDEWAYS, "lines": PHONE_LINES, "figures": figures_on_a_phone, "axe": audit},
    "dark": {"check_contrast": CHECK_CONTRAST, "controls": (CONTROL_COLOURS, INTERACTIVE_MARK),
             "figure_colours": figure_colours, "axe": audit},
    "phone-dark": {"axe": audit},
    "interactive": {"vega": (VEGA_ON_THE_PAGE, VEGA_BUNDLE), "figures": operate_the_figures},
}
_VISITS = {}


def visit(browser, page, view):
    """One load of the page in a view ("desktop" 1,400 px, "phone" 400 px and touch, "dark" 1,400 px in dark
    mode, "phone-dark" 400 px in dark mode, "interactive" 1,400 px): every probe of PROBES[view], in order (a probe is JavaScript, JavaScript and
    its argument, or a Python function of the tab for one that acts on the page), then the page's script and console
    errors and the URLs it asked for, those refused for leaving the book's folder apart."""
    if (page, view) not in _VISITS:
        viewport, phone, mode = VIEWS[view]
        tab = open_page(browser, page, viewport, phone=phone, mode=mode)
        found = {}
        for name, probe in PROBES[view].items():
            if callable(probe):
                found[name] = probe(tab)
                continue
            script, *argument = probe if isinstance(probe, tuple) else (probe,)
            found[name] = tab.evaluate(script, *argument)
        found["page_errors"], found["console_errors"] = tab.errors, tab.console_errors
        found["requests"], found["outside"] = tab.requests, tab.outside
        tab.context.close()
        _VISITS[page, view] = found
    return _VISITS[page, view]


def desktop(browser, page):
    return visit(browser, page, "desktop")


PHONE_PAGES = [PAGES[0], CHAPTERS[0]]


@pytest.mark.parametrize("page", PHONE_PAGES)
def test_phone_menu_opens_the_chapter_list(browser, page):
    tab = open_page(browser, page, PHONE, phone=True)
    assert on_screen(tab, "nav.bd-links a.reference") == 0, "the chapter list shows before the tap"
    tap_visible(tab, ".primary-toggle")
    shown = on_screen(tab, "nav.bd-links a.reference")
    assert shown >= len(CHAPTERS), f"after tapping the menu at 400 px, {shown} chapter links are visible"
    tab.context.close()


def test_phone_contents_drawer_opens_and_closes_after_a_tap_on_a_section(browser):
    tab = open_page(browser, CHAPTERS[0], PHONE, phone=True)
    assert on_screen(tab, "nav.page-toc a") == 0, "the contents show before the tap"
    tap_visible(tab, ".secondary-toggle")
    shown = on_screen(tab, "nav.page-toc a")
    assert shown >= 3, f"after tapping the contents button at 400 px, {shown} section links are visible"
    tap_visible(tab, "nav.page-toc a", index=2)  # _static/book.js closes the drawer
    assert tab.evaluate("() => location.hash").startswith("#"), "the tap did not go to the section"
    assert on_screen(tab, "nav.page-toc a") == 0, "the contents drawer stays open over the page after the tap"
    assert not tab.evaluate("() => [...document.querySelectorAll('dialog')].some((d) => d.open)")
    tab.context.close()


@pytest.mark.parametrize("page", PAGES)
def test_phone_page_is_no_wider_than_the_screen(browser, page):
    width = visit(browser, page, "phone")["page_width"]
    assert width <= PHONE["width"], f"at {PHONE['width']} px the page is {width} px wide: the reader scrolls sideways"


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_phone_code_wraps_instead_of_scrolling_sideways(browser, page):
    """At 400 px an 88-column line does not fit: code wraps in the column (_static/custom.css), every fold open."""
    found = visit(browser, page, "phone")["sideways"]
    assert not found["code"], f"{len(found['code'])} code blocks scroll sideways at 400 px, first {found['code'][:3]}"


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_phone_printed_tables_keep_their_lines(browser, page):
    """A printed table keeps its columns at 400 px: no line of an output that is not marked to wrap (a sentence,
    numbers, printed code: _static/book.js) wraps; a table's type shrinks, and a wide one scrolls in its own box."""
    wrapped = visit(browser, page, "phone")["lines"]["wrapped"]
    assert not wrapped, f"{len(wrapped)} printed tables wrap their lines at 400 px, first {wrapped[:3]}"


@pytest.mark.parametrize("page", PAGES)
def test_phone_nothing_scrolls_sideways_but_a_table_with_its_cue(browser, page):
    """At 400 px, every fold open: no printed output scrolls sideways unless it is a table too wide for the column
    at 8.5 px, and then its box shows the cue; a Markdown table that scrolls shows its cue; no display formula is
    wider than the column (the page draws it smaller)."""
    found = visit(browser, page, "phone")["sideways"]
    assert not found["outputs"], f"{len(found['outputs'])} outputs that are not tables scroll sideways, first {found['outputs'][:3]}"
    for kind in ("tables", "markdown"):
        silent = [table["text"] for table in found[kind] if not table["cue"]]
        assert not silent, f"{len(silent)} {kind} scroll sideways with no cue, first {silent[:3]}"
    assert not found["formulas"], f"{found['formulas']} display formulas are wider than the column at 400 px"


# "Back to top" shown (the theme shows it after the reader scrolls up; sphinx-book-theme never shows it from 1,200 px
# on), then the pieces of the article it covers: text, formulas and pictures under the button that the reader would
# otherwise see (what the page's bar already hides does not count: the button is hidden while the page is asked).
BACK_TO_TOP = """async () => {
  const button = document.getElementById("pst-back-to-top");
  window.scrollTo({top: Math.min(4000, document.body.scrollHeight / 2), behavior: "instant"});
  await new Promise((done) => setTimeout(done, 200));
  window.scrollBy({top: -200, behavior: "instant"});
  await new Promise((done) => setTimeout(done, 300));
  const box = button.getBoundingClientRect();
  if (getComputedStyle(button).display === "none" || !box.width) return {shown: false, covered: []};
  button.style.visibility = "hidden";
  const seen = (r, node) => {
    const left = Math.max(r.left, box.left), right = Math.min(r.right, box.right);
    const top = Math.max(r.top, box.top), bottom = Math.min(r.bottom, box.bottom);
    if (right <= left || bottom <= top) return false;
    const el = document.elementFromPoint((left + right) / 2, (top + bottom) / 2);
    return !!el && (el === node || el.contains(node) || node.contains(el));
  };
  const covered = [];
  const walker = document.createTreeWalker(document.querySelector("article"), NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (!node.textContent.trim()) continue;
    const range = document.createRange();
    range.selectNodeContents(node);
    if ([...range.getClientRects()].some((r) => seen(r, node.parentElement))) covered.push(node.textContent.trim().slice(0, 40));
  }
  document.querySelectorAll("article mjx-container, article img, article svg").forEach((el) => {
    if (seen(el.getBoundingClientRect(), el)) covered.push(el.tagName.toLowerCase());
  });
  button.style.visibility = "";
  return {shown: true, covered};
}"""
TABLET = {"width": 900, "height": 1000}


@pytest.mark.parametrize("width", ["phone", "tablet"])
@pytest.mark.parametrize("page", [CHAPTERS[0], CHAPTERS[4]])
def test_back_to_top_covers_no_text(browser, page, width):
    """The theme's "Back to top" appears when the reader scrolls up (below 1,200 px); it sits in the article's bar
    (custom.css), never over a line of text, a formula or a figure."""
    tab = open_page(browser, page, PHONE if width == "phone" else TABLET, phone=width == "phone")
    try:
        found = tab.evaluate(BACK_TO_TOP)
    finally:
        tab.context.close()
    assert found["shown"], "Back to top did not appear after scrolling up"
    assert not found["covered"], f"Back to top covers {len(found['covered'])} pieces of the page, first {found['covered'][:3]}"


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_phone_wrapped_code_keeps_its_indentation(browser, page):
    """A line of code wrapped at 400 px continues to the right of its own indentation, never at the left edge."""
    lines = visit(browser, page, "phone")["lines"]
    assert not lines["lost"], f"{len(lines['lost'])} wrapped lines of code lose their indentation, first {lines['lost'][:3]}"


def test_phone_wraps_some_code_with_a_hanging_indent(browser):
    """The check above must have something to check: chapter 9's excerpts of the kernel wrap on a phone."""
    page = next(p for p in CHAPTERS if p.startswith("chapters/09_"))
    assert visit(browser, page, "phone")["lines"]["hung"] >= 5


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_phone_fold_toggles_are_44_px_tall(browser, page):
    heights = visit(browser, page, "phone")["toggle_heights"]
    assert heights, "no fold toggle on the page"
    small = [(round(h), text) for h, text in heights if h < 44]
    assert not small, f"{len(small)} of {len(heights)} fold toggles are under 44 px tall on a phone, first {small[:3]}"


@pytest.mark.parametrize("page", PAGES)
def test_nothing_scrolls_sideways_at_desktop_width(browser, page):
    found = desktop(browser, page)["sideways"]
    problems = []
    if found["code"]:
        problems.append(f"{len(found['code'])} code blocks scroll sideways, first {found['code'][:3]}")
    if found["outputs"] or found["tables"]:
        wide = found["outputs"] + [table["text"] for table in found["tables"]]
        problems.append(f"{len(wide)} outputs scroll sideways, first {wide[:3]}")
    if found["formulas"]:
        problems.append(f"{found['formulas']} display formulas are wider than the column (break them with aligned)")
    assert not problems, f"at {DESKTOP['width']} px: " + "; ".join(problems)


@pytest.mark.parametrize("page", PAGES)
def test_no_raw_tex_and_no_mathjax_error(browser, page):
    report = desktop(browser, page)
    errors, prose, page_errors = report["mathjax_errors"], report["prose"], report["page_errors"]
    assert not errors, f"MathJax errors: {errors[:5]}"
    raw = [prose[max(0, m.start() - 40) : m.end() + 40].replace("\n", " ") for m in RAW_TEX.finditer(prose)]
    assert not raw, f"{len(raw)} pieces of raw TeX in the text, for example {raw[:3]}"
    assert not page_errors, f"script errors on the page: {page_errors[:3]}"


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_every_fold_looks_the_same(browser, page):
    """One fold style: each toggle a tinted title row with a chevron (no browser triangle), a check's fold the
    same but plain; what differs is only what it holds."""
    folds = desktop(browser, page)["folds"]
    assert folds, "no fold on the page"
    triangles = [fold["text"] for fold in folds if fold["triangle"]]
    assert not triangles, f"folds that open with the browser's triangle: {triangles[:3]}"
    for kind in (False, True):
        looks = {(fold["background"], fold["weight"]) for fold in folds if fold["check"] is kind}
        assert len(looks) <= 1, f"{'check' if kind else 'other'} folds in {len(looks)} styles: {sorted(looks)}"


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_an_asides_code_is_inside_its_box(page):
    """tools/asides.py: a cell tagged deeper right after a "Going deeper" aside, or solution right after a
    "Solution" dropdown, is drawn inside that box, open: an aside, or an exercise's answer, is one fold."""
    article = source_soup(page).select_one("article")
    for aside in article.select("div.dropdown.admonition"):
        title = aside.select_one(".admonition-title").get_text(" ", strip=True)
        role = "deeper" if title.startswith("Going deeper") else "solution" if title.startswith("Solution") else None
        after = aside.find_next_sibling()
        if role and after is not None:
            classes = after.get("class", [])
            assert not ("cell" in classes and f"tag_{role}" in classes), f"the code of {title!r} sits outside its box"
        for cell in aside.select("div.cell.tag_deeper, div.cell.tag_solution"):
            assert not cell.select("details"), f"the code inside {title!r} is folded a second time"


def test_an_answer_with_reasoning_is_one_fold():
    """Chapter 1's exercise 2: its written answer, its code and its checks open from one Solution box."""
    article = source_soup(CHAPTERS[0]).select_one("article")
    boxes = [box for box in article.select("div.dropdown.admonition")
             if box.select_one(".admonition-title").get_text(strip=True).startswith("Solution")]
    assert boxes, "no Solution box in chapter 1"
    assert all(box.select("div.cell.tag_solution") for box in boxes), "a Solution box without its code"
    assert all(box.select("div.cell.tag_check") for box in boxes), "a Solution box without its checks"


@pytest.mark.parametrize("page", NOTEBOOK_PAGES)
def test_each_cells_printed_output_is_one_box(page):
    """A cell's prints and its value in one output box: the book renders the committed, merged outputs."""
    for output in source_soup(page).select("article div.cell_output"):
        boxes = [box for box in output.find_all("div", recursive=False) if "output" in box.get("class", [])]
        text = [box for box in boxes if {"stream", "text_plain", "stderr"} & set(box.get("class", []))]
        assert len(text) <= 1, f"a cell prints in {len(text)} boxes: {text[0].get_text()[:60]!r}"


@pytest.mark.parametrize("view", ["desktop", "dark"])
def test_the_check_line_reads_at_4_5_to_1(browser, view):
    """WCAG AA for text: the "✓ N checks" line at 4.5:1 or more against its background, light and dark."""
    ratios = visit(browser, CHAPTERS[0], view)["check_contrast"]
    assert ratios, "no check line on the page"
    low = [(round(ratio, 2), text) for ratio, text in ratios if ratio < 4.5]
    assert not low, f"in {view} mode {len(low)} check lines are below 4.5:1, first {low[:2]}"


@pytest.mark.parametrize("page", PAGES)
def test_no_console_error_on_a_first_visit(browser, page):
    """Nothing stored yet (a first visit): the theme once logged "Got invalid theme mode" on every page."""
    report = desktop(browser, page)
    assert not report["console_errors"], f"the console shows errors: {report['console_errors'][:3]}"


@pytest.mark.parametrize("page", PAGES)
def test_no_request_leaves_the_books_folder(browser, page):
    """Offline means offline: nothing the page asks for on load comes from the network or from beside the build."""
    outside = desktop(browser, page)["outside"]
    assert not outside, f"{len(outside)} requests left the book's folder, first {outside[:3]}"


@pytest.mark.parametrize("view", ["desktop", "dark", "phone", "phone-dark"])
@pytest.mark.parametrize("page", PAGES)
def test_no_serious_accessibility_violation(browser, page, view):
    """axe-core (WCAG 2.0-2.2, A and AA) finds no serious or critical violation on the page, light and dark, at
    1,400 px and on a 400 px touch screen, with every fold open."""
    report = visit(browser, page, view)["axe"]
    if report is None:
        pytest.skip("axe-core is not installed: run `npm ci` (make test does where npm is present)")
    assert report["theme"] == ("dark" if "dark" in view else "light"), f"the page shows the {report['theme']} theme"
    found = [f"{v['rule']} ({v['impact']}, {v['count']} elements: {v['help']}; first {v['elements']})"
             for v in report["violations"]]
    assert not found, f"axe-core {report['version']} in the {view} view: " + "; ".join(found)


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


# ------------------------------------------------------------------------------------- the interactive figures


def test_the_book_has_interactive_figures():
    """The figures below are found by their markup: finding none means the markup changed, not that all is well."""
    assert INTERACTIVE, f"no chapter stores an interactive figure (an output with class {INTERACTIVE_MARK!r})"


def first_frame_alts(page):
    """The alt text of each interactive figure's cell: it describes the first frame (the stored PNG)."""
    cells = json.loads((ROOT / f"{page}.ipynb").read_text())["cells"]
    return [c.get("metadata", {}).get("mystnb", {}).get("image", {}).get("alt", "") for c in cells
            if any(INTERACTIVE_MARK in "".join(o.get("data", {}).get("text/html", "")) for o in c.get("outputs", []))]


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_figures_reach_the_page_with_a_label_that_stays_true(page):
    """Each figure the notebook stores is on the built page with a static label (tools/interactive_figures.py): its
    number, its caption and its control. Not the first frame's alt text, which would go stale once the control
    moves: that stays on the PNG."""
    figures = source_soup(page).select(f"article .{INTERACTIVE_MARK}")
    stored = interactive_in_notebook(page)
    assert len(figures) == stored, f"{len(figures)} figures on the page, {stored} in the notebook"
    for figure, alt in zip(figures, first_frame_alts(page)):
        label = figure.get("aria-label", "")
        assert figure.get("role") == "group", "a figure without role=group"
        assert re.match(r"Interactive figure \d+\.\d+: \S", label), f"the label does not name the figure: {label[:80]!r}"
        caption = figure.find_parent("figure").select_one("figcaption").get_text(" ", strip=True)
        assert " ".join(caption.split()[2:8]) in label, f"the label leaves out the caption: {label[:80]!r}"
        assert re.search(r" Control: (a slider|sliders|radio buttons|a checkbox)", label), label[-120:]
        assert not alt or alt[:40] not in label, f"the label repeats the first frame's alt text: {label[:80]!r}"


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_figures_fit_the_phone_column(browser, page):
    """At 400 px each figure is laid out for the column (panels stacked, tools/interactive_figures.py) and drawn no
    wider than it, at no less than 3/4 of its size (11 px text stays 8 px or more); its controls stay in it."""
    figures = visit(browser, page, "phone")["figures"]
    assert len(figures) == interactive_in_notebook(page), f"{len(figures)} figures at 400 px"
    for n, figure in enumerate(figures, 1):
        assert figure["drawn"], f"figure {n} was not drawn at 400 px"
        assert figure["right"] <= figure["column"] + 1 and not figure["scrolls"], f"figure {n} is wider than the column"
        assert figure["scale"] >= 0.75, f"figure {n} is drawn at {figure['scale']:.2f} of its size: too small to read"
        assert all(right <= figure["column"] + 1 for right in figure["controls"]), f"figure {n}: a control off the column"


# Text of a drawn figure that reaches past its picture (px beyond the SVG's left or right edge), which the reader
# does not see: the worst line.
TEXT_OUTSIDE = """(svg) => {
  const box = svg.getBoundingClientRect();
  return [...svg.querySelectorAll("text")].map((t) => {
    const b = t.getBoundingClientRect();
    return [Math.max(b.right - box.right, box.left - b.left), t.textContent.slice(0, 50)];
  }).sort((a, b) => b[0] - a[0])[0] || [0, ""];
}"""


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_text_stays_in_the_picture_at_every_slider_step_on_a_phone(browser, page):
    """At 400 px, each figure's first slider stepped through up to 8 of its values from the keyboard: no line of
    text runs out of the picture at any of them (Figure 2.2's written-out sums once did, by 28 px, at some rows)."""
    tab = open_page(browser, page, PHONE, phone=True)
    try:
        figures, worst = tab.locator(f".{INTERACTIVE_MARK}"), []
        for n in range(figures.count()):
            picture = figures.nth(n).locator(".vega-embed > svg").first
            picture.wait_for(timeout=20_000)
            slider = figures.nth(n).locator(".vega-bind input[type=range]")
            for step in range(8 if slider.count() else 1):
                worst.append((*picture.evaluate(TEXT_OUTSIDE), f"figure {n + 1}, step {step}"))
                if slider.count():
                    slider.first.focus()
                    tab.keyboard.press("ArrowRight")
                    tab.wait_for_timeout(150)
        out = max(worst)
        assert out[0] <= 1, f"{out[2]}: text runs {out[0]:.0f} px out of the picture: {out[1]!r}"
    finally:
        tab.context.close()


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_controls_in_dark_mode_match_their_box(browser, page):
    """The figure's radio buttons, checkboxes and sliders are drawn in the scheme of the box behind them (in dark
    mode a dark card; Chromium's dark scheme once drew an unchosen radio button as a dark disk on a light box), with
    an accent of the book's."""
    controls = visit(browser, page, "dark")["controls"]
    assert controls, "no figure control on the page"
    wrong = [c for c in controls if c["scheme"] != ("light" if c["light"] else "dark")]
    assert not wrong, f"{len(wrong)} controls drawn in a scheme unlike the box behind them, first {wrong[:2]}"
    assert all(c["accent"] not in ("auto", "") for c in controls), "the controls keep the browser's accent colour"


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_figures_follow_the_dark_theme(browser, page):
    """In dark mode a figure's card is dark, like the page, and its axis labels and titles are light on it (they sat
    on a bright light-grey block)."""
    figures = visit(browser, page, "dark")["figure_colours"]
    assert figures and all(f["drawn"] for f in figures), f"a figure was not drawn in dark mode: {figures}"
    for n, figure in enumerate(figures, 1):
        assert figure["card"] < 0.3, f"figure {n}: its card is light ({figure['card']:.2f}) on the dark page"
        assert figure["text"] and min(figure["text"]) > 0.6, f"figure {n}: dark text on the dark card"
        assert figure["background"] in (None, "transparent"), f"figure {n}: its own background {figure['background']}"


# At 400 px, each figure scrolled so that the top of its picture is just under the top of the screen, and then so
# that its bottom is at the bottom: where its first control is each time, the picture's edges, and the room between
# the controls and the picture.
TOGETHER = """(figure) => {
  const svg = figure.querySelector(".vega-embed > svg"), bindings = figure.querySelector(".vega-bindings");
  const control = figure.querySelector(".vega-bind input");
  const at = (y) => { window.scrollTo({top: y, behavior: "instant"}); return control.getBoundingClientRect(); };
  const top = svg.getBoundingClientRect().top + scrollY, bottom = svg.getBoundingClientRect().bottom + scrollY;
  const first = at(bindings.getBoundingClientRect().top + scrollY - 10);
  const gap = svg.getBoundingClientRect().top - bindings.getBoundingClientRect().bottom;
  const pictureInView = svg.getBoundingClientRect().top < innerHeight;
  const last = at(bottom - innerHeight + 10);
  return {height: Math.round(bottom - top), gap: Math.round(gap), screen: innerHeight, pictureInView,
          first: [Math.round(first.top), Math.round(first.bottom)], last: [Math.round(last.top), Math.round(last.bottom)]};
}"""


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_control_and_picture_share_a_phone_screen(browser, page):
    """At 400 px the controls come before the picture, next to it, and stay on the screen while the reader scrolls
    down the picture (Figure 4.5's slider sat 850 px under the top of its picture, 11.7's checkboxes 700 px)."""
    tab = open_page(browser, page, PHONE, phone=True)
    try:
        figures = tab.locator(f".{INTERACTIVE_MARK}")
        for n in range(figures.count()):
            figures.nth(n).locator(".vega-embed > svg").first.wait_for(timeout=20_000)
            found = figures.nth(n).evaluate(TOGETHER)
            where = f"figure {n + 1}: {found}"
            assert 0 <= found["gap"] <= 24, f"{where}: the controls are not right above the picture"
            assert found["pictureInView"] and 0 <= found["first"][0] and found["first"][1] <= found["screen"], where
            assert 0 <= found["last"][0] and found["last"][1] <= found["screen"], \
                f"{where}: the control leaves the screen while the picture scrolls"
    finally:
        tab.context.close()


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_figures_show_their_first_frame_without_scripts(browser, page):
    """With JavaScript off each figure is its first frame (the PNG the notebook stores) under its caption, not an
    empty box."""
    context = browser.new_context(viewport=DESKTOP, java_script_enabled=False)
    try:
        tab = context.new_page()
        tab.goto(html_path(page).as_uri(), wait_until="load")
        frames = tab.evaluate("""(mark) => [...document.querySelectorAll("." + mark)].map((figure) => {
          const img = figure.querySelector("img"), box = img ? img.getBoundingClientRect() : null;
          const caption = figure.closest("figure") && figure.closest("figure").querySelector("figcaption");
          return {img: !!img, loaded: !!img && img.complete && img.naturalWidth > 0, width: box ? box.width : 0,
                  height: box ? box.height : 0, alt: img ? img.alt : "", caption: caption ? caption.textContent.trim() : ""};
        })""", INTERACTIVE_MARK)
        assert len(frames) == interactive_in_notebook(page), f"{len(frames)} figures without scripts"
        for n, frame in enumerate(frames, 1):
            assert frame["img"] and frame["loaded"], f"figure {n}: no first frame without scripts: {frame}"
            assert frame["width"] > 200 and frame["height"] > 100, f"figure {n}: its first frame is not shown: {frame}"
            assert frame["alt"] and frame["caption"], f"figure {n}: a first frame without alt text or caption"
    finally:
        context.close()


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_page_loads_vega_once_from_the_books_own_folder(page):
    bundles = [s.get("src") for s in source_soup(page).find_all("script") if VEGA_BUNDLE in (s.get("src") or "")]
    assert len(bundles) == 1, f"Vega's bundle is loaded {len(bundles)} times: {bundles}"
    assert not urllib.parse.urlparse(bundles[0]).scheme and not bundles[0].startswith("//"), bundles[0]
    target = (html_path(page).parent / bundles[0].split("?")[0]).resolve()
    assert target.is_file() and HTML.resolve() in target.parents, f"{bundles[0]} is not a file of the book"


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_figures_move_from_the_keyboard(browser, page):
    """Every figure draws, and its control, labelled and focused, changes the picture from the keyboard."""
    figures = visit(browser, page, "interactive")["figures"]
    assert len(figures) == interactive_in_notebook(page), f"{len(figures)} figures in the browser"
    for n, figure in enumerate(figures, 1):
        where = f"figure {n} ({figure['label'][:50]!r})"
        assert figure["drawn"], f"{where} was not drawn: {figure['error']}"
        assert figure["control"] in ("range", "radio", "checkbox"), f"{where}: a {figure['control']} control"
        assert figure["control_label"], f"{where}: its {figure['control']} control has no label"
        assert figure["focused"], f"{where}: its control does not take the keyboard's focus"
        assert figure["changed"], f"{where}: its {figure['control']} control, used from the keyboard, changed nothing"
        if figure["ring_gap"] is not None:
            assert figure["ring_gap"] >= 0, f"{where}: the slider's focus ring covers its value ({figure['ring_gap']:.1f} px)"


@pytest.mark.parametrize("page", INTERACTIVE)
def test_interactive_figures_stay_in_the_book_offline(browser, page):
    """Vega runs from the book's bundle, fetched once; no request leaves the book's folder, even after the controls
    moved; the console stays clean."""
    report = visit(browser, page, "interactive")
    inside = HTML.as_uri() + "/"
    fetched = [url for url in report["requests"] if VEGA_BUNDLE in url]
    assert len(fetched) == 1 and fetched[0].startswith(inside), f"Vega's bundle fetched as {fetched}"
    assert report["vega"]["embed"], "vega-embed is not on the page"
    assert len(report["vega"]["scripts"]) == 1, f"Vega's script on the page {len(report['vega']['scripts'])} times"
    assert not report["outside"], f"{len(report['outside'])} requests left the book, first {report['outside'][:3]}"
    assert not report["page_errors"], f"script errors: {report['page_errors'][:3]}"
    assert not report["console_errors"], f"console errors: {report['console_errors'][:3]}"
