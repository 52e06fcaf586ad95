"""The Colab edition of the chapters (colab/chapters, written by tools/make_colab.py): current, and free of MyST.

The first tests check the committed copies against the chapters; the rest check each rule of the conversion on a
tiny book of two chapters, so that a broken rule fails on its own.
"""

import importlib.util
import json
import pathlib
import re

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
COPIES = ROOT / CONFIG["repository"]["path_to_book"] / "chapters"
GUIDES = sorted((ROOT / "guide").glob("*.ipynb"))
GUIDE_COPIES = ROOT / CONFIG["repository"]["path_to_book"] / "guide"
BASE = CONFIG["html"]["baseurl"].rstrip("/") + "/"

spec = importlib.util.spec_from_file_location("make_colab", ROOT / "tools" / "make_colab.py")
mc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mc)

ROLE = re.compile(r"\{[A-Za-z][\w:+.-]*\}`")
DIRECTIVE = re.compile(r"^\s*(`{3,}|~{3,}|:{3,})\s*\{", re.MULTILINE)
RELATIVE_PAGE_LINK = re.compile(r"\]\((?![A-Za-z][A-Za-z0-9+.-]*:)[^)\s]*\.(?:ipynb|md)(?:#[^)\s]*)?\)")
FOLDED = ("hide-cell", "hide-input", "remove-input")


def load(path):
    return json.loads(path.read_text())


def text(cell):
    return "".join(cell["source"])


# ------------------------------------------------------------------------------------------- the committed copies


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    out = tmp_path_factory.mktemp("colab")
    mc.build(out)
    return out / "chapters"


@pytest.mark.parametrize("kind", ["chapters", "guide"])
def test_copies_are_current(fresh, kind):
    fresh, copies = fresh.parent / kind, COPIES.parent / kind
    expected = sorted(p.name for p in fresh.glob("*.ipynb"))
    committed = sorted(p.name for p in copies.glob("*.ipynb"))
    assert committed == expected, f"colab copies {committed} do not match the pages {expected}: run make colab"
    for name in expected:
        assert (copies / name).read_bytes() == (fresh / name).read_bytes(), f"colab/{kind}/{name} is stale: run make colab"


def test_generator_is_deterministic(fresh, tmp_path):
    mc.build(tmp_path)
    for path in fresh.glob("*.ipynb"):
        assert (tmp_path / "chapters" / path.name).read_bytes() == path.read_bytes(), path.name


def test_the_colab_button_opens_the_copies():
    """The launch button's URL is {colab_url}/github/{org}/{repo}/blob/{branch}/{path_to_book}/{page}.ipynb."""
    for chapter in CHAPTERS:
        assert (COPIES / chapter.name).is_file(), f"no Colab copy of {chapter.name}: run make colab"
    assert "colab/**" in CONFIG["exclude_patterns"], "the copies must stay out of the book build"
    assert BASE.startswith("https://")


@pytest.mark.parametrize("chapter", CHAPTERS + GUIDES, ids=lambda p: p.stem)
def test_copy_reads_like_the_book(chapter):
    copy = load(COPIES.parent / chapter.parent.name / chapter.name)
    for cell in copy["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        md = text(cell)
        assert not ROLE.search(md), f"{cell['id']}: MyST role left: {ROLE.search(md).group(0)}"
        assert not DIRECTIVE.search(md), f"{cell['id']}: MyST directive left"
        assert "{glue" not in md, f"{cell['id']}: unresolved glue"
        assert not RELATIVE_PAGE_LINK.search(md), f"{cell['id']}: relative link {RELATIVE_PAGE_LINK.search(md).group(0)}"
    banner = text(copy["cells"][0])
    assert f"{BASE}{chapter.parent.name}/{chapter.stem}.html" in banner and "git clone" in banner


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_copy_folds_solutions_and_keeps_the_code(chapter):
    original, copy = load(chapter), load(COPIES / chapter.name)
    by_id = {c["id"]: c for c in copy["cells"]}
    for cell in original["cells"]:
        if cell["cell_type"] != "code" or cell["id"] not in by_id:
            continue
        new = by_id[cell["id"]]
        assert new["outputs"] == mc.interactive_outputs(cell) and new["execution_count"] is None
        if any(tag in cell["metadata"].get("tags", []) for tag in FOLDED):
            assert new["metadata"].get("cellView") == "form", f"{cell['id']} is a solution Colab would show open"
            assert new["source"][0].startswith("# @title "), f"{cell['id']} has no form title"
            assert text(new).endswith(text(cell))
        elif "raises-exception" not in cell["metadata"].get("tags", []):
            assert text(new) == text(cell), f"{cell['id']}: the copy's code differs from the chapter's"
    assert copy["metadata"].get("accelerator") == original["metadata"].get("accelerator")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_copy_keeps_the_setup_cell(chapter):
    first = next(c for c in load(chapter)["cells"] if c["cell_type"] == "code")
    copied = next(c for c in load(COPIES / chapter.name)["cells"] if c["cell_type"] == "code")
    assert copied["id"] == first["id"] and text(copied) == text(first)
    assert "cellView" not in copied["metadata"]


# ------------------------------------------------------------------------------------------- the rules, one by one

BIB = r"""
@inproceedings{one2020,
  title = {{FlashAttention}: Fast and {IO}-Aware},
  author = {Kaiser, {\L}ukasz},
  year = {2020}
}
@article{two2021, title = "Self-attention Does Not Need $O(n^2)$ Memory", author = {Rabe, Markus N. and R{\'e}, Christopher}, year = 2021}
@misc{many2022,
  title = {Many},
  author = {Fran{\c{c}}ois Fleuret and Ainslie, Joshua and de Jong, Michiel},
  year = {2022}
}
@misc{others2023, title = {Induction}, author = {Olsson, Catherine and others}, year = {2023}}
"""


def glue_output(name, plain):
    prefix = "application/papermill.record/"
    return {
        "data": {prefix + "text/plain": plain},
        "metadata": {"scrapbook": {"mime_prefix": prefix, "name": name}},
        "output_type": "display_data",
    }


def notebook(cells, **metadata):
    return {"cells": cells, "metadata": metadata, "nbformat": 4, "nbformat_minor": 5}


def md(cell_id, source):
    return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": source}


def code(cell_id, source, tags=(), outputs=()):
    meta = {"tags": list(tags)} if tags else {}
    return {"cell_type": "code", "id": cell_id, "metadata": meta, "source": source, "execution_count": 1,
            "outputs": list(outputs)}


@pytest.fixture()
def book(tmp_path):
    (tmp_path / "_config.yml").write_text(
        yaml.safe_dump(
            {
                "title": "Tiny",
                "repository": {"url": "https://github.com/org/repo", "branch": "main", "path_to_book": "colab"},
                "html": {"baseurl": "https://org.github.io/repo/"},
            }
        )
    )
    (tmp_path / "references.bib").write_text(BIB)
    (tmp_path / "intro.md").write_text("# Intro\n\n(notation)=\n## Notation\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "attention.py").write_text("")
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    (chapters / "plot.png").write_bytes(b"")
    one = notebook(
        [
            md("cell-000", "# One\n\nIntro."),
            code("cell-001", "import sys", tags=["remove-cell"]),
            code("cell-002", "glue('n', 1048576)\nglue('x', 0.39412)", outputs=[
                glue_output("n", "1048576"), glue_output("x", "0.39412"), glue_output("s", "'word'")
            ]),
            code("cell-003", "glue('late', 2)", tags=["remove-cell"], outputs=[glue_output("late", "2")]),
            code("cell-004", "1 / 0", tags=["raises-exception"]),
            md("cell-005", "## Exercises\n\n**1.** Try it."),
            code("cell-006", "assert True", tags=["hide-cell"]),
            md("cell-007", "**2.** Again."),
            code("cell-008", "assert 1", tags=["hide-input"]),
        ],
        accelerator="GPU",
    )
    (chapters / "01_one.ipynb").write_text(json.dumps(one))
    two = notebook([md("cell-000", "# Two\n\n(sec-two)=\n## A section"), code("cell-001", "glue('m', 7)", outputs=[glue_output("m", "7")])])
    (chapters / "02_two.ipynb").write_text(json.dumps(two))
    return mc.Book(tmp_path)


def convert(book, source, doc="chapters/01_one"):
    return mc.convert_blocks(book, doc, source)


@pytest.mark.parametrize(
    "plain, spec, shown",
    [("1048576", ",d", "1,048,576"), ("0.39412", ".2f", "0.39"), ("0.39412", "s", "0.39412"), ("3", "", "3"),
     ("'word'", "s", "word"), ("0.5", ".1%", "50.0%"), ("2.0", "d", "2"), ("0.000123", ".1e", "1.2e-04")],
)
def test_glue_format_spec_as_myst_nb(plain, spec, shown):
    assert mc.format_plain_text(plain, spec) == shown


def test_glue_roles_take_the_stored_values(book):
    assert convert(book, "{glue:text}`n:,d` and {glue:text}`x:.2f` and {glue:text}`x`") == "1,048,576 and 0.39 and 0.39412"
    assert convert(book, "{glue}`s`, {glue:text}`s`, {glue:any}`n`") == "'word', word, 1048576"
    assert convert(book, "{glue:text}`02_two.ipynb::m:.1f`") == "7.0"
    with pytest.raises(mc.ConversionError, match="no glued value 'missing'"):
        convert(book, "{glue:text}`missing`")


def test_bibtex_names_accents_and_braces():
    entries = mc.parse_bibtex(BIB)
    assert set(entries) == {"one2020", "two2021", "many2022", "others2023"}
    assert mc.latex_to_text(entries["one2020"].fields["title"]) == "FlashAttention: Fast and IO-Aware"
    assert mc.latex_to_text(entries["two2021"].fields["title"]) == "Self-attention Does Not Need $O(n^2)$ Memory"
    assert mc.latex_to_text(r"{\L}ukasz R{\'e} Fran{\c{c}}ois Lebr{\'o}n G\"{o}del \'Ecole {\ss} na\"ive") == (
        "Łukasz Ré François Lebrón Gödel École ß naïve"
    )
    assert mc.latex_to_text("A -- B --- C \\& D") == "A – B — C & D"
    authors = {key: entry.persons["author"] for key, entry in entries.items()}
    assert mc.format_authors(authors["one2020"]) == "Kaiser"
    assert mc.format_authors(authors["two2021"]) == "Rabe and Ré"
    assert mc.format_authors(authors["many2022"]) == "Fleuret et al."
    assert mc.format_authors(authors["others2023"]) == "Olsson et al."
    assert mc.last_name("Michiel de Jong") == "de Jong" and mc.last_name("de Jong, Michiel") == "de Jong"


def test_bibtex_is_read_by_pybtex_and_a_broken_file_is_an_error():
    entries = mc.parse_bibtex(BIB)
    assert type(entries["one2020"]).__module__.startswith("pybtex")
    with pytest.raises(mc.ConversionError, match="references.bib"):
        mc.parse_bibtex("@article{broken, title = {no end}")


def test_the_course_bibliography_reads_without_raw_tex():
    book = mc.Book(ROOT)
    titles = [mc.reference(book, "bibliography", key)[2] for key in book.bib]
    assert titles and not [t for t in titles if "$" in t or "\\" in t or "{" in t]


def test_citations_become_readable_references(book):
    assert convert(book, "as shown {cite}`one2020`.") == "as shown (Kaiser, 2020, *FlashAttention: Fast and IO-Aware*)."
    assert convert(book, "{cite:p}`one2020,two2021`") == (
        "(Kaiser, 2020, *FlashAttention: Fast and IO-Aware*; Rabe and Ré, 2021, *Self-attention Does Not Need $O(n^2)$ Memory*)"
    )
    assert convert(book, "{cite:t}`many2022` showed") == "Fleuret et al. (2022, *Many*) showed"
    with pytest.raises(mc.ConversionError, match="not in references.bib"):
        convert(book, "{cite}`nobody1999`")


@pytest.mark.parametrize(
    "link, url",
    [
        ("[ch 2](02_two.ipynb)", "[ch 2](https://org.github.io/repo/chapters/02_two.html)"),
        ("[ch 2](02_two.md#a-section)", "[ch 2](https://org.github.io/repo/chapters/02_two.html#a-section)"),
        ("[intro](../intro.md)", "[intro](https://org.github.io/repo/intro.html)"),
        ("[code](../lib/attention.py)", "[code](https://github.com/org/repo/blob/main/lib/attention.py)"),
        ("![a plot](plot.png)", "![a plot](https://raw.githubusercontent.com/org/repo/main/chapters/plot.png)"),
        ("[web](https://example.org/x.md)", "[web](https://example.org/x.md)"),
        ("[here](#local)", "[here](#local)"),
        ("[notation](#notation)", "[notation](https://org.github.io/repo/intro.html#notation)"),
        ("{doc}`../intro`", "[Intro](https://org.github.io/repo/intro.html)"),
        ("{doc}`the second <02_two>`", "[the second](https://org.github.io/repo/chapters/02_two.html)"),
        ("{ref}`sec-two`", "[A section](https://org.github.io/repo/chapters/02_two.html#sec-two)"),
        ("{ref}`there <notation>`", "[there](https://org.github.io/repo/intro.html#notation)"),
        ("`[code](02_two.ipynb)`", "`[code](02_two.ipynb)`"),
    ],
)
def test_links_point_at_the_published_book(book, link, url):
    assert convert(book, link) == url


def test_broken_link_is_an_error(book):
    with pytest.raises(mc.ConversionError, match="not a file"):
        convert(book, "[gone](03_gone.ipynb)")


@pytest.mark.parametrize(
    "myst, markdown",
    [
        ("```{note}\nMind the $n^2$.\n```", "> **Note**\n>\n> Mind the $n^2$."),
        (":::{admonition} Why $\\sqrt{d}$\nBecause.\n\nTwice.\n:::", "> **Why $\\sqrt{d}$**\n>\n> Because.\n>\n> Twice."),
        ("````{tip}\n```{math}\nx\n```\n````", "> **Tip**\n>\n> $$\n> x\n> $$"),
        ("```{math}\n:label: eq-one\na = b\n```", "$$\na = b\n$$"),
        ("```{figure} plot.png\n:alt: A rising line\n:name: fig-one\n\nThe caption.\n```",
         "![A rising line](https://raw.githubusercontent.com/org/repo/main/chapters/plot.png)\n\n*The caption.*"),
        ("```{eval-rst}\n.. automodule:: lib\n```",
         "> This part is rendered only in [the book](https://org.github.io/repo/chapters/01_one.html)."),
        ("```{code-block} python\n:linenos:\nx = 1\n```", "```python\nx = 1\n```"),
        ("```python\nx = {glue:text}`n`\n```", "```python\nx = {glue:text}`n`\n```"),
        ("Text\n\\begin{align}\na &= b\n\\end{align}\nmore", "Text\n\n$$\n\\begin{align}\na &= b\n\\end{align}\n$$\n\nmore"),
        ("$$\n\\begin{aligned} a &= b \\end{aligned}\n$$ (eq-two)", "$$\n\\begin{aligned} a &= b \\end{aligned}\n$$"),
        ("(my-label)=\n## Heading\n% a comment\n+++\nText", "## Heading\nText"),
        ("Uses {math}`x^2` and {sub}`2`.", "Uses $x^2$ and <sub>2</sub>."),
        ("Para\n```{warning}\nCareful.\n```\nNext", "Para\n\n> **Warning**\n>\n> Careful.\n\nNext"),
    ],
)
def test_directives_become_plain_markdown(book, myst, markdown):
    assert convert(book, myst) == markdown


def test_unknown_myst_is_an_error_not_a_silent_copy(book):
    with pytest.raises(mc.ConversionError, match="directive"):
        convert(book, "```{tab-set}\nx\n```")
    with pytest.raises(mc.ConversionError, match="role"):
        convert(book, "{unknown-role}`x`")


def test_notebook_conversion_folds_solutions_and_drops_book_plumbing(book):
    nb = mc.convert_notebook(book, book.root / "chapters" / "01_one.ipynb")
    cells = {c["id"]: c for c in nb["cells"]}
    assert nb["cells"][0]["id"] == "colab-banner"
    assert "https://org.github.io/repo/chapters/01_one.html" in text(nb["cells"][0])
    assert "GPU" in text(nb["cells"][0]) and "on purpose" in text(nb["cells"][0])
    assert nb["metadata"]["accelerator"] == "GPU"
    assert text(cells["cell-001"]) == "import sys"  # the setup cell stays as it is
    assert "cell-003" not in cells  # a hidden cell that only glues is for the book alone
    assert text(cells["cell-004"]).startswith("# This cell stops with an error on purpose")
    for cell_id, number in (("cell-006", 1), ("cell-008", 2)):
        assert cells[cell_id]["metadata"]["cellView"] == "form"
        assert cells[cell_id]["source"][0] == f"# @title Solution to exercise {number} (double-click to show)\n"
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None for c in nb["cells"] if c["cell_type"] == "code")
    assert mc.is_glue_only("glue('a', 1)\nglue('b', 2)") and not mc.is_glue_only("a = glue('a', 1)")


# ------------------------------------------------------------------------------ the reading convention, in Colab


def figure_cell(cell_id, name, caption, tags=()):
    cell = code(cell_id, "draw()", tags=tags, outputs=[{"output_type": "display_data", "metadata": {},
                                                        "data": {"image/png": "iVBOR", "text/plain": "<Figure>"}}])
    cell["metadata"]["mystnb"] = {"figure": {"name": name, "caption": caption}, "image": {"alt": "x" * 30}}
    return cell


def role(cell_id, text, tag):
    """A code cell as tools/refresh_notebooks.py leaves it: role tag, fold tag, prompts."""
    import lib.notebook

    fold, show, hide = lib.notebook.ROLES[tag]
    cell = code(cell_id, text, tags=[tag, fold])
    cell["metadata"]["mystnb"] = {"code_prompt_show": show, "code_prompt_hide": hide}
    return cell


@pytest.fixture()
def convention_book(tmp_path):
    """Two numbered chapters and a guide page outside the numbering, in the reading convention."""
    (tmp_path / "_config.yml").write_text(yaml.safe_dump({
        "title": "Tiny",
        "repository": {"url": "https://github.com/org/repo", "branch": "main", "path_to_book": "colab"},
        "html": {"baseurl": "https://org.github.io/repo/"},
        "sphinx": {"config": {"numfig": True, "numfig_format": {"figure": "Figure %s"}}},
    }))
    (tmp_path / "_toc.yml").write_text(yaml.safe_dump({
        "format": "jb-book", "root": "intro",
        "parts": [{"caption": "Chapters", "numbered": True,
                   "chapters": [{"file": "chapters/01_one"}, {"file": "chapters/02_two"}]},
                  {"caption": "Reference", "chapters": [{"file": "guide/bugs"}]}],
    }))
    (tmp_path / "intro.md").write_text("# Intro\n")
    chapters, guide = tmp_path / "chapters", tmp_path / "guide"
    chapters.mkdir()
    guide.mkdir()
    (chapters / "plot.png").write_bytes(b"")
    one = notebook([
        md("cell-000", "# One\n\nText."),
        code("cell-001", "import sys", tags=["remove-cell"]),
        md("cell-002", "As {numref}`fig-two-b` shows, and {numref}`fig-one-a`, and {numref}`Plot %s <fig-one-b>`."),
        figure_cell("cell-003", "fig-one-a", "The first, with $x^2$."),
        md("cell-004", "```{figure} plot.png\n:name: fig-one-md\n:alt: a picture drawn in Markdown\n\nDrawn by hand.\n```"),
        figure_cell("cell-005", "fig-one-b", "The third.", tags=["plot", "hide-input"]),
        role("cell-006", "with checks() as check:\n    check(True)", "check"),
        md("cell-007", ":::{admonition} Going deeper: the `fast` path\n:class: dropdown\n\nWhy it differs.\n:::"),
        role("cell-008", "study()", "deeper"),
        {**role("cell-012", "raise ValueError", "deeper"), "metadata": {
            "tags": ["deeper", "hide-cell", "raises-exception"]}},
        md("cell-009", "## Exercises\n\n**1.** Try it."),
        role("cell-010", "answer = 42", "solution"),
        md("cell-011", ":::{admonition} Solution\n:class: dropdown\n\nBecause **42**.\n:::"),
    ])
    (chapters / "01_one.ipynb").write_text(json.dumps(one))
    two = notebook([md("cell-000", "# Two"), figure_cell("cell-001", "fig-two-a", "A."),
                    figure_cell("cell-002", "fig-two-b", "B, see {numref}`fig-one-a`.")])
    (chapters / "02_two.ipynb").write_text(json.dumps(two))
    bugs = notebook([md("cell-000", "# Bugs\n\nSee {numref}`fig-bugs`."), figure_cell("cell-001", "fig-bugs", "A bug.")])
    (guide / "bugs.ipynb").write_text(json.dumps(bugs))
    return mc.Book(tmp_path)


def test_figures_are_numbered_as_sphinx_numbers_them(convention_book):
    figures = convention_book.figures
    assert {name: number for name, (_, number, _) in figures.items()} == {
        "fig-one-a": "1.1", "fig-one-md": "1.2", "fig-one-b": "1.3", "fig-two-a": "2.1", "fig-two-b": "2.2",
        "fig-bugs": "1",  # a page outside the numbered chapters counts its figures alone
    }
    assert figures["fig-two-b"][0] == "chapters/02_two"


def test_numref_becomes_a_figure_number_linking_to_the_book(convention_book):
    converted = mc.convert_blocks(convention_book, "chapters/01_one", source(one_cell(convention_book, "cell-002")))
    assert converted == (
        "As [Figure 2.2](https://org.github.io/repo/chapters/02_two.html#fig-two-b) shows, and "
        "[Figure 1.1](https://org.github.io/repo/chapters/01_one.html#fig-one-a), and "
        "[Plot 1.3](https://org.github.io/repo/chapters/01_one.html#fig-one-b)."
    )
    assert "{numref}" not in mc.convert_blocks(convention_book, "guide/bugs", "See {numref}`fig-bugs`.")


def test_each_figure_cell_is_followed_by_its_numbered_caption(convention_book):
    nb = mc.convert_notebook(convention_book, convention_book.root / "chapters" / "01_one.ipynb")
    ids = [c["id"] for c in nb["cells"]]
    assert ids[ids.index("cell-003") + 1] == "cell-003-caption"
    captions = {c["id"]: text(c) for c in nb["cells"] if c["id"].endswith("-caption")}
    assert captions == {"cell-003-caption": "**Figure 1.1:** The first, with $x^2$.",
                        "cell-005-caption": "**Figure 1.3:** The third."}
    markdown_figure = text(next(c for c in nb["cells"] if c["id"] == "cell-004"))
    assert markdown_figure.endswith("\n\n**Figure 1.2:** Drawn by hand.")
    two = mc.convert_notebook(convention_book, convention_book.root / "chapters" / "02_two.ipynb")
    caption = text(next(c for c in two["cells"] if c["id"] == "cell-002-caption"))
    assert caption == "**Figure 2.2:** B, see [Figure 1.1](https://org.github.io/repo/chapters/01_one.html#fig-one-a)."


def test_form_titles_follow_the_role_tags(convention_book):
    nb = mc.convert_notebook(convention_book, convention_book.root / "chapters" / "01_one.ipynb")
    titles = {c["id"]: c["source"][0] for c in nb["cells"] if c["metadata"].get("cellView") == "form"}
    assert titles == {
        "cell-005": "# @title Plotting code (double-click to show)\n",
        "cell-006": "# @title The checks (double-click to show)\n",
        "cell-008": "# @title Going deeper: the fast path (double-click to show the code)\n",
        "cell-010": "# @title Solution to exercise 1 (double-click to show)\n",
        "cell-012": "# @title Going deeper: the fast path (double-click to show the code)\n",
    }
    raising = next(c for c in nb["cells"] if c["id"] == "cell-012")  # the form title stays on the first line
    assert raising["source"][1].startswith("# This cell stops with an error on purpose")


@pytest.mark.parametrize(
    "myst, markdown",
    [
        (":::{admonition} Solution\n:class: dropdown\n\nBecause **42**.\n:::",
         "<details>\n<summary><strong>Solution</strong></summary>\n\nBecause **42**.\n\n</details>"),
        (":::{admonition} Going deeper: the `fast` path\n:class: dropdown\n\nWhy $n^2$.\n:::",
         ("<details>\n<summary><strong>Going deeper: the <code>fast</code> path</strong></summary>\n\nWhy $n^2$.\n\n"
          "</details>")),
        ("```{dropdown} More\nText.\n```", "<details>\n<summary><strong>More</strong></summary>\n\nText.\n\n</details>"),
        (":::{admonition} Not folded\n:class: tip\n\nShown.\n:::", "> **Not folded**\n>\n> Shown."),
    ],
)
def test_dropdowns_become_details_blocks(convention_book, myst, markdown):
    assert mc.convert_blocks(convention_book, "chapters/01_one", myst) == markdown


def test_the_guide_gets_a_colab_edition(convention_book, tmp_path):
    written = mc.build(tmp_path / "out", convention_book.root)
    names = sorted(p.relative_to(tmp_path / "out").as_posix() for p in written)
    assert names == ["chapters/01_one.ipynb", "chapters/02_two.ipynb", "guide/bugs.ipynb"]


def one_cell(book, cell_id):
    cells = json.loads((book.root / "chapters" / "01_one.ipynb").read_text())["cells"]
    return next(c for c in cells if c["id"] == cell_id)


def source(cell):
    return "".join(cell["source"])


def test_an_interactive_figure_keeps_its_snippet_for_colab():
    """lib.interactive's output stays in the Colab edition (Colab loads Vega from the web), the PNG does not."""
    import sys

    sys.path.insert(0, str(ROOT))
    from lib import interactive

    figure = interactive.sliding_window(4)
    bundle = figure._repr_mimebundle_()
    cell = figure_cell("cell-009", "fig-window", "The slider sets the window.")
    cell["metadata"]["mystnb"]["image"]["alt"] = 'A band of "weights" under a causal mask.'
    cell["outputs"] = [{"output_type": "execute_result", "execution_count": 3, "metadata": {}, "data": bundle},
                       {"output_type": "stream", "name": "stdout", "text": "printed\n"}]
    kept = mc.interactive_outputs(cell)
    assert len(kept) == 1 and set(kept[0]["data"]) == {"text/html", "text/plain"}
    assert kept[0]["output_type"] == "display_data"
    html = "".join(kept[0]["data"]["text/html"])
    assert 'aria-label="A band of &quot;weights&quot; under a causal mask."' in html
    assert "_static" not in html and "https://cdn.jsdelivr.net/npm" in html
    assert mc.interactive_outputs(figure_cell("cell-010", "fig-plain", "A plain figure.")) == []
