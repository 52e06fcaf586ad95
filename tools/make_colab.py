"""Write the Colab edition of every notebook page: colab/chapters/NN_slug.ipynb and colab/guide/*.ipynb, the
notebooks the book's Colab button opens.

Usage: python tools/make_colab.py            (rewrites colab/ from chapters/ and guide/; `make colab` runs it)
       python tools/make_colab.py --setup-cell   (first writes tools/setup_cell.py into every chapter and guide
                                                  page, as their first code cell, after the setup cell changed)

Colab shows a chapter without the book's machinery, so each copy is the chapter with:
- every glue role replaced by its value exactly as the book prints it, read from the chapter's stored outputs
  (format specs such as {glue:text}`name:.2f` honoured); a role without a stored value is an error;
- every citation role replaced by authors, year and title from references.bib (read with pybtex, as the book does);
- links to other pages of the book (.ipynb/.md paths, {doc}, {ref}, {numref}, {eq}) pointing at the published book,
  whose address is `html.baseurl` in _config.yml; other files of the repository point at GitHub;
- MyST directives (admonitions, math, figures, ...) written as plain Markdown, and bare amsmath blocks put in $$;
- folded cells (hide-cell, hide-input) turned into Colab form cells, which Colab shows folded, titled by their
  role tag as the book's fold is ("Solution to exercise 2", "The checks", "Plotting code", "Going deeper: ...");
- dropdown admonitions ("Solution", "Going deeper: ...") written as <details> blocks, folded as in the book;
- every named figure numbered as the book numbers it (chapter.index: "Figure 7.2"), its caption a Markdown cell
  after the figure cell, and {numref} roles to it written "Figure 7.2", linking to the figure in the book;
- outputs and execution counts removed, except an interactive figure's (lib/interactive.py): its HTML is kept, with
  the cell's alt text as its aria-label, for Colab to draw when it opens the notebook (the snippet loads Vega from
  jsDelivr, never from the book's _static); then a banner cell first, and `"accelerator": "GPU"` kept from the chapter so
  Colab offers a GPU runtime for the chapters that ask for one.
The setup cell stays exactly as in the chapter: in Colab it clones the course library and installs nothing.
Whatever the generator does not know how to convert stops it with an error naming the chapter, never a silent copy.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import posixpath
import re
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "colab"
PAGE_SUFFIXES = (".ipynb", ".md")


class ConversionError(ValueError):
    """Something in a chapter that the Colab copy cannot show faithfully."""


# ---------------------------------------------------------------------------------------------------- settings


class Book:
    """What the conversion needs to know about the book: addresses, pages, glued values, references, labels."""

    def __init__(self, root: pathlib.Path = ROOT):
        self.root = root
        config = yaml.safe_load((root / "_config.yml").read_text())
        self.baseurl = config["html"]["baseurl"].rstrip("/") + "/"
        self.repo_url = config["repository"]["url"].rstrip("/")
        self.branch = config["repository"].get("branch", "main")
        self.title = config.get("title", "")
        self.substitutions = (config.get("parse") or {}).get("myst_substitutions") or {}
        self.chapters = sorted((root / "chapters").glob("*.ipynb"))
        self.notebooks = [*self.chapters, *sorted((root / "guide").glob("*.ipynb"))]  # every notebook page
        self.glue = {docname(self, path): glue_values(read_notebook(path)) for path in self.notebooks}
        self.bib = parse_bibtex((root / "references.bib").read_text()) if (root / "references.bib").exists() else {}
        self.labels, self.equations = collect_labels(self)
        numfig = ((config.get("sphinx") or {}).get("config") or {}).get("numfig_format") or {}
        self.figure_format = numfig.get("figure", "Fig. %s")
        self.numbers = chapter_numbers(self)
        self.figures = collect_figures(self)

    def page_url(self, doc: str, fragment: str = "") -> str:
        return f"{self.baseurl}{doc}.html{fragment}"

    def file_url(self, path: str, raw: bool = False) -> str:
        if raw:
            org_repo = self.repo_url.split("github.com/", 1)[1]
            return f"https://raw.githubusercontent.com/{org_repo}/{self.branch}/{path}"
        return f"{self.repo_url}/blob/{self.branch}/{path}"

    def doc_exists(self, doc: str) -> bool:
        return any((self.root / f"{doc}{suffix}").is_file() for suffix in PAGE_SUFFIXES)

    def doc_title(self, doc: str) -> str:
        for suffix in PAGE_SUFFIXES:
            path = self.root / f"{doc}{suffix}"
            if path.is_file():
                texts = markdown_texts(path)
                for text in texts:
                    for line in text.splitlines():
                        if line.startswith("# "):
                            return line[2:].strip()
        raise ConversionError(f"no page {doc!r} with a title")


def docname(book: Book, path: pathlib.Path) -> str:
    return path.relative_to(book.root).with_suffix("").as_posix()


def read_notebook(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


def source(cell: dict) -> str:
    text = cell.get("source", "")
    return "".join(text) if isinstance(text, list) else text


def markdown_texts(path: pathlib.Path) -> list[str]:
    if path.suffix == ".ipynb":
        return [source(c) for c in read_notebook(path)["cells"] if c["cell_type"] == "markdown"]
    return [path.read_text()]


# ---------------------------------------------------------------------------------------------------- glue

def glue_values(nb: dict) -> dict[str, dict]:
    """name -> mime bundle of every value a chapter glued, as myst_nb.glue stores it in the cell outputs."""
    values = {}
    for cell in nb["cells"]:
        for output in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            meta = output.get("metadata", {}).get("scrapbook")
            if not meta:
                continue
            prefix = meta.get("mime_prefix", "")
            data = output.get("data", {}).items()  # multi-line text may be stored as a list of lines
            values[meta["name"]] = {k[len(prefix) :]: v if isinstance(v, str) else "".join(v) for k, v in data}
    return values


def format_plain_text(text: str, fmt_spec: str) -> str:
    """The text of {glue:text}`name:fmt`, as myst-nb writes it (myst_nb.core.variables.format_plain_text)."""
    try:
        value = ast.literal_eval(text)
    except (SyntaxError, ValueError):
        value = text
    if fmt_spec == "":
        return str(value)
    type_char = fmt_spec[-1]
    if type_char == "s":
        value = str(value)
    elif type_char in "bcdoxX":
        value = int(value)
    elif type_char in "eEfFgGn%":
        value = float(value)
    return format(value, fmt_spec)


def glue_lookup(book: Book, doc: str, key: str) -> dict:
    other, sep, name = key.partition("::")
    if sep:
        target = resolve_path(doc, other.strip())
        target = target.rsplit(".", 1)[0] if target.endswith(PAGE_SUFFIXES) else target
    else:
        target, name = doc, key
    try:
        return book.glue[target][name.strip()]
    except KeyError:
        raise ConversionError(
            f"{doc}: no glued value {name.strip()!r} in the stored outputs of {target} (refresh the chapter)"
        ) from None


def split_glue_key(content: str) -> tuple[str, str]:
    """'name', 'name:fmt', 'doc::name' or 'doc::name:fmt' as (key with its document, format spec; 's' if none)."""
    document, sep, rest = content.rpartition("::")
    name, colon, fmt = rest.rpartition(":")
    if not colon:
        name, fmt = rest, "s"
    return document + sep + name, fmt


def glue_text(book: Book, doc: str, content: str) -> str:
    key, fmt = split_glue_key(content.strip())
    bundle = glue_lookup(book, doc, key)
    if "text/plain" not in bundle:
        raise ConversionError(f"{doc}: glued value {key!r} has no text/plain")
    try:
        return format_plain_text(bundle["text/plain"], fmt)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"{doc}: cannot format glued value {key!r} with {fmt!r}: {exc}") from None


def glue_any(book: Book, doc: str, key: str, block: bool = False) -> str:
    bundle = glue_lookup(book, doc, key)
    if "text/markdown" in bundle:
        return bundle["text/markdown"]
    if "text/latex" in bundle:
        latex = strip_math_delimiters(bundle["text/latex"])
        return f"$$\n{latex}\n$$" if block else f"${latex}$"
    if "text/html" in bundle:
        return bundle["text/html"]
    if "text/plain" in bundle:
        return bundle["text/plain"]
    raise ConversionError(f"{doc}: glued value {key!r} is not text (a glued figure cannot be shown without outputs)")


def strip_math_delimiters(latex: str) -> str:
    latex = latex.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\[", "\\]"), ("\\(", "\\)")):
        if latex.startswith(left) and latex.endswith(right) and len(latex) >= len(left) + len(right):
            return latex[len(left) : len(latex) - len(right)].strip()
    return latex


# ---------------------------------------------------------------------------------------------------- BibTeX

def latex_to_text(text: str) -> str:
    """BibTeX field text as Unicode, as pybtex reads it: accents and special letters converted, braces dropped."""
    from pybtex.richtext import Text

    return re.sub(r"\s+", " ", Text.from_latex(text).render_as("text")).strip()


def parse_bibtex(text: str) -> dict:
    """key -> pybtex Entry for every entry of a BibTeX file, read by pybtex (sphinxcontrib-bibtex's own reader)."""
    from pybtex.database import parse_string
    from pybtex.exceptions import PybtexError

    try:
        return dict(parse_string(text, "bibtex").entries)
    except PybtexError as exc:
        raise ConversionError(f"references.bib: {exc}") from None


def last_name(name) -> str:
    """The family name (with its 'von' part) of one BibTeX name, given as text or as a pybtex Person."""
    from pybtex.database import Person

    person = Person(name) if isinstance(name, str) else name
    return latex_to_text(" ".join(person.prelast_names + person.last_names))


def format_authors(persons) -> str:
    """'Kaiser', 'Rabe and Ré' or 'Fleuret et al.' from an entry's list of pybtex Persons."""
    persons = list(persons)
    others = bool(persons) and str(persons[-1]).lower() == "others"
    names = [last_name(p) for p in persons if str(p).lower() != "others"]
    if len(names) >= 3 or (others and names):
        return f"{names[0]} et al."
    if len(names) == 2:
        return f"{names[0]} and {names[1]}"
    return names[0] if names else "Anonymous"


def reference(book: Book, doc: str, key: str) -> tuple[str, str, str]:
    try:
        entry = book.bib[key]
    except KeyError:
        raise ConversionError(f"{doc}: citation key {key!r} is not in references.bib") from None
    authors = format_authors(entry.persons.get("author") or entry.persons.get("editor") or [])
    year = latex_to_text(entry.fields.get("year", "n.d."))
    title = latex_to_text(entry.fields.get("title", key))
    return authors, year, title


def cite(book: Book, doc: str, role: str, content: str) -> str:
    keys = [k.strip() for k in content.split(",") if k.strip()]
    refs = [reference(book, doc, key) for key in keys]
    style = role.partition(":")[2] or "p"
    if style in ("p", "ps", "alp", "alps"):
        return "(" + "; ".join(f"{a}, {y}, *{t}*" for a, y, t in refs) + ")"
    if style in ("t", "ts"):
        return "; ".join(f"{a} ({y}, *{t}*)" for a, y, t in refs)
    if style == "author":
        return "; ".join(a for a, _, _ in refs)
    if style == "year":
        return "; ".join(y for _, y, _ in refs)
    raise ConversionError(f"{doc}: citation role {{{role}}} is not supported")


# ---------------------------------------------------------------------------------------------------- links


def resolve_path(doc: str, target: str) -> str:
    """A path written in page doc, relative to the repository root."""
    if target.startswith("/"):
        return posixpath.normpath(target.lstrip("/"))
    return posixpath.normpath(posixpath.join(posixpath.dirname(doc), target))


def make_id(label: str) -> str:
    """The HTML id Sphinx gives a label (docutils.nodes.make_id)."""
    from docutils.nodes import make_id as docutils_make_id

    return docutils_make_id(label)


def collect_labels(book: Book) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """label -> (document, title) for every `(label)=` target, and equation label -> document, in the book's pages."""
    labels, equations = {}, {}
    pages = [*book.notebooks, *sorted(book.root.glob("*.md"))]
    for path in pages:
        doc = docname(book, path)
        for text in markdown_texts(path):
            lines = text.splitlines()
            for i, line in enumerate(lines):
                m = re.match(r"^\(([^()\s]+)\)=\s*$", line)
                if m:
                    following = next((x for x in lines[i + 1 :] if x.strip()), "")
                    labels[m.group(1)] = (doc, re.sub(r"^#+\s*", "", following).strip())
                m = re.match(r"^\s*\$\$.*\(([^()\s]+)\)\s*$", line) or re.match(r"^\s*:label:\s*(\S+)\s*$", line)
                if m:
                    equations[m.group(1)] = doc
    return labels, equations


def chapter_numbers(book: Book) -> dict[str, int]:
    """document -> its chapter number, as the book numbers them: in _toc.yml order, through the parts marked
    `numbered` (without a _toc.yml, the chapters in file order)."""
    toc_path = book.root / "_toc.yml"
    if not toc_path.exists():
        return {docname(book, path): i for i, path in enumerate(book.chapters, 1)}
    toc = yaml.safe_load(toc_path.read_text())
    numbered = [entry["file"] for part in toc.get("parts", []) if part.get("numbered")
                for entry in part.get("chapters", [])]
    return {re.sub(r"\.(ipynb|md)$", "", page): i for i, page in enumerate(numbered, 1)}


FIGURE_DIRECTIVE = re.compile(r"^ {0,3}(`{3,}|:{3,})\s*\{figure\}.*$")


def markdown_figures(text: str) -> list[tuple[str, str]]:
    """(name, caption) of every named {figure} directive in a Markdown cell, in order."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        m = FIGURE_DIRECTIVE.match(line)
        if not m:
            continue
        fence = m.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        options, content = split_options(lines[i + 1 : end])
        if options.get("name"):
            found.append((options["name"], "\n".join(content).strip().split("\n\n")[0]))
    return found


def collect_figures(book: Book) -> dict[str, tuple[str, str, str]]:
    """figure name -> (document, number, caption) for every named figure of the notebooks, numbered as Sphinx
    does with numfig_secnum_depth 1: "7.2" is the second figure of chapter 7; a page outside the numbered
    chapters counts its figures alone ("2")."""
    figures = {}
    for path in book.notebooks:
        doc = docname(book, path)
        prefix = f"{book.numbers[doc]}." if doc in book.numbers else ""
        count = 0
        for cell in read_notebook(path)["cells"]:
            if cell["cell_type"] == "markdown":
                named = markdown_figures(source(cell))
            else:
                figure = cell.get("metadata", {}).get("mystnb", {}).get("figure", {})
                named = [(figure["name"], str(figure.get("caption", "")))] if figure.get("name") else []
            for name, caption in named:
                count += 1
                figures[name] = (doc, f"{prefix}{count}", caption)
    return figures


def figure_label(book: Book, number: str) -> str:
    return book.figure_format.replace("%s", number)


def rewrite_link(book: Book, doc: str, target: str, image: bool = False) -> str:
    """A link target of page doc as an address that works from Colab."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):  # https:, mailto:, data: ...
        return target
    path, hash_, fragment = target.partition("#")
    fragment = hash_ + fragment
    if not path:
        label = fragment[1:]
        if label in book.labels and book.labels[label][0] != doc:
            return book.page_url(book.labels[label][0], "#" + make_id(label))
        return target  # an anchor on the same page
    full = resolve_path(doc, path)
    for suffix in PAGE_SUFFIXES:
        if full.endswith(suffix) and book.doc_exists(full[: -len(suffix)]):
            return book.page_url(full[: -len(suffix)], fragment)
    if (book.root / full).exists():
        return book.file_url(full, raw=image) + fragment
    raise ConversionError(f"{doc}: link to {target!r}, which is not a file of the repository")


def ref_role(book: Book, doc: str, role: str, content: str) -> str:
    text, target = split_title_target(content)
    if role == "doc":
        full = resolve_path(doc, target)
        full = full.rsplit(".", 1)[0] if full.endswith(PAGE_SUFFIXES) else full
        if not book.doc_exists(full):
            raise ConversionError(f"{doc}: {{doc}} role to {target!r}, which is not a page of the book")
        return f"[{text or book.doc_title(full)}]({book.page_url(full)})"
    if role == "eq":
        if target not in book.equations:
            raise ConversionError(f"{doc}: {{eq}} role to unknown equation label {target!r}")
        return f"[{text or 'this equation'}]({book.page_url(book.equations[target], '#equation-' + make_id(target))})"
    if target in book.figures:
        page, number, caption = book.figures[target]
        if role == "numref":
            shown = text.replace("%s", number).replace("{number}", number).replace("{name}", caption) if text else ""
            shown = shown or figure_label(book, number)
        else:
            shown = text or caption
        return f"[{convert_inline(book, doc, shown)}]({book.page_url(page, '#' + make_id(target))})"
    if target not in book.labels:
        raise ConversionError(f"{doc}: {{{role}}} role to unknown label {target!r}")
    page, title = book.labels[target]
    text = text or title
    if role == "numref":
        text = text.replace("{name}", title).replace("%s", "").replace("{number}", "").strip() or title
    return f"[{text}]({book.page_url(page, '#' + make_id(target))})"


def split_title_target(content: str) -> tuple[str, str]:
    m = re.match(r"^(.*?)\s*<([^<>]+)>\s*$", content, re.DOTALL)
    return (m.group(1).strip(), m.group(2).strip()) if m else ("", content.strip())


# ---------------------------------------------------------------------------------------------------- inline


INLINE = re.compile(
    r"(?P<role>\{(?P<name>[A-Za-z][\w:+.-]*)\}(?P<ticks>`+)(?P<content>.+?)(?P=ticks))"
    r"|(?P<code>(?P<cticks>`+).+?(?P=cticks))"
    r"|(?P<link>(?P<bang>!?)\[(?P<text>(?:[^\[\]]|\[[^\]]*\])*)\]\(\s*(?P<target><[^>]*>|[^)\s]+)(?P<title>\s+\"[^\"]*\")?\s*\))",
    re.DOTALL,
)
SIMPLE_ROLES = {
    "math": lambda c: f"${c}$",
    "code": lambda c: f"`{c}`",
    "sub": lambda c: f"<sub>{c}</sub>",
    "sup": lambda c: f"<sup>{c}</sup>",
    "kbd": lambda c: f"<kbd>{c}</kbd>",
    "abbr": lambda c: c,
    "term": lambda c: split_title_target(c)[0] or c,
    "guilabel": lambda c: f"**{c.replace('&', '')}**",
    "menuselection": lambda c: "**" + c.replace("-->", "→") + "**",
    "emphasis": lambda c: f"*{c}*",
    "strong": lambda c: f"**{c}**",
}
PY_ROLES = ("py:func", "py:class", "py:meth", "py:mod", "py:attr", "py:data", "py:obj", "py:exc",
            "func", "class", "meth", "mod", "attr", "data", "obj", "exc")


def convert_role(book: Book, doc: str, name: str, content: str) -> str:
    if name in ("glue:text",):
        return glue_text(book, doc, content)
    if name in ("glue", "glue:any"):
        return glue_any(book, doc, content)
    if name == "glue:md":  # {glue:md}`name:format`, the format being the Markdown flavour
        key = re.sub(r"(?<!:):(commonmark|gfm|myst)$", "", content)
        return glue_lookup(book, doc, key).get("text/markdown") or glue_any(book, doc, key)
    if name == "cite" or name.startswith("cite:"):
        return cite(book, doc, name, content)
    if name in ("doc", "ref", "numref", "eq", "any"):
        return ref_role(book, doc, "ref" if name == "any" else name, content)
    if name in SIMPLE_ROLES:
        return SIMPLE_ROLES[name](content)
    if name in PY_ROLES:
        text, target = split_title_target(content)
        target = target.lstrip("~!.")
        shown = text or (target.rsplit(".", 1)[-1] if content.lstrip().startswith("~") else target)
        return f"[`{shown}`]({book.page_url('api', '#' + target)})"
    if name == "download":
        text, target = split_title_target(content)
        return f"[{text or posixpath.basename(target)}]({rewrite_link(book, doc, target)})"
    raise ConversionError(f"{doc}: the MyST role {{{name}}} has no Colab form (teach tools/make_colab.py)")


def convert_inline(book: Book, doc: str, text: str) -> str:
    def replace(m):
        if m.group("role"):
            return convert_role(book, doc, m.group("name"), m.group("content"))
        if m.group("code"):
            return m.group("code")
        target = m.group("target").strip("<>")
        inner = convert_inline(book, doc, m.group("text"))
        return f"{m.group('bang')}[{inner}]({rewrite_link(book, doc, target, image=bool(m.group('bang')))}{m.group('title') or ''})"

    text = INLINE.sub(replace, text)
    for key, value in book.substitutions.items():
        text = re.sub(r"\{\{\s*" + re.escape(key) + r"\s*\}\}", str(value), text)
    return text


# ---------------------------------------------------------------------------------------------------- blocks

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,}|:{3,})\s*(?P<info>.*?)\s*$")
DIRECTIVE = re.compile(r"^\{(?P<name>[A-Za-z][\w:+.-]*)\}\s*(?P<arg>.*)$")
ADMONITIONS = {"note": "Note", "warning": "Warning", "tip": "Tip", "important": "Important", "hint": "Hint",
               "caution": "Caution", "attention": "Attention", "danger": "Danger", "error": "Error",
               "seealso": "See also", "todo": "To do", "versionadded": "New", "versionchanged": "Changed",
               "deprecated": "Deprecated"}
ASIDES = ("admonition", "dropdown", "margin", "sidebar", "topic", "epigraph", "pull-quote", "highlights", "card")


def split_options(body: list[str]) -> tuple[dict[str, str], list[str]]:
    """A directive's :key: value options (or a --- YAML block) and the content lines after them."""
    options = {}
    if body and body[0].strip() == "---":
        end = next((i for i in range(1, len(body)) if body[i].strip() == "---"), None)
        if end is not None:
            options = {str(k): str(v) for k, v in (yaml.safe_load("\n".join(body[1:end])) or {}).items()}
            return options, body[end + 1 :]
    i = 0
    while i < len(body):
        m = re.match(r"^\s*:([\w-]+):\s*(.*)$", body[i])
        if not m:
            break
        options[m.group(1)] = m.group(2).strip()
        i += 1
    return options, body[i:]


def blockquote(title: str, body: str) -> str:
    lines = [f"> **{title}**" if title else None, ">" if title and body.strip() else None]
    lines = [x for x in lines if x is not None]
    lines += [f"> {line}" if line.strip() else ">" for line in body.strip("\n").splitlines()]
    return "\n".join(lines)


def details(title: str, body: str) -> str:
    """A folded block, as Colab's Markdown shows a dropdown: the title always, the body on a click."""
    title = re.sub(r"`([^`]+)`", r"<code>\1</code>", title)
    title = re.sub(r"\*\*([^*]+)\*\*", r"\1", title)
    return f"<details>\n<summary><strong>{title}</strong></summary>\n\n{body.strip()}\n\n</details>"


def list_table(doc: str, options: dict, body: str) -> str:
    rows, current = [], None
    for line in body.splitlines():
        if re.match(r"^\*\s+-\s", line) or re.match(r"^\*\s*$", line):
            current = []
            rows.append(current)
            line = line[1:]
        m = re.match(r"^\s*-\s+(.*)$", line)
        if m and current is not None:
            current.append(m.group(1).strip())
        elif line.strip() and current:
            current[-1] += " " + line.strip()
    if not rows:
        raise ConversionError(f"{doc}: an empty list-table")
    width = max(len(r) for r in rows)
    rows = [r + [""] * (width - len(r)) for r in rows]
    header = int(options.get("header-rows", "0") or 0)
    head, rest = (rows[0], rows[1:]) if header else ([""] * width, rows)
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * width]
    out += ["| " + " | ".join(r) + " |" for r in rest]
    return "\n".join(out)


def convert_directive(book: Book, doc: str, name: str, arg: str, body_lines: list[str]) -> str:
    options, content = split_options(body_lines)
    body = convert_blocks(book, doc, "\n".join(content)).strip("\n")
    if name == "dropdown" or (name == "admonition" and "dropdown" in options.get("class", "").split()):
        return details(convert_inline(book, doc, arg) or "Details", body)
    if name in ADMONITIONS:
        text = (convert_inline(book, doc, arg) + "\n\n" + body).strip() if arg else body
        return blockquote(ADMONITIONS[name], text)
    if name in ASIDES:
        return blockquote(convert_inline(book, doc, arg), body)
    if name == "math":
        return f"$$\n{chr(10).join(content).strip()}\n$$"
    if name in ("figure", "image"):
        url = rewrite_link(book, doc, arg.strip(), image=True)
        alt = options.get("alt", "").replace("]", ")").replace("[", "(") or (body.splitlines()[0] if body else "")
        if name == "figure" and options.get("name") in book.figures:
            number = book.figures[options["name"]][1]
            body = f"**{figure_label(book, number)}:** {body}".strip()
            return f"![{alt}]({url})\n\n{body}"
        return f"![{alt}]({url})" + (f"\n\n*{body}*" if name == "figure" and body else "")
    if name in ("code-block", "code", "sourcecode", "code-cell"):
        return f"```{arg.split()[0] if arg else ''}\n" + "\n".join(content) + "\n```"
    if name == "raw" and arg.strip() == "html":
        return "\n".join(content)
    if name == "eval-rst":
        return blockquote("", f"This part is rendered only in [the book]({book.page_url(doc)}).")
    if name == "list-table":
        table = list_table(doc, options, body)
        return (f"**{convert_inline(book, doc, arg)}**\n\n" if arg else "") + table
    if name in ("glue", "glue:any", "glue:md"):
        return glue_any(book, doc, arg.strip(), block=True)
    if name == "glue:math":
        return f"$$\n{strip_math_delimiters(glue_lookup(book, doc, arg.strip())['text/latex'])}\n$$"
    raise ConversionError(f"{doc}: the MyST directive {{{name}}} has no Colab form (teach tools/make_colab.py)")


def convert_blocks(book: Book, doc: str, text: str) -> str:
    """Markdown of one cell (or directive body) with every MyST construct written as plain Markdown."""
    lines, out, plain, i = text.split("\n"), [], [], 0
    in_math = False

    def flush():
        if plain:
            out.append(convert_inline(book, doc, "\n".join(plain)))
            plain.clear()

    def block(text: str, after: int):
        """A converted block, set off by blank lines so that it neither continues nor swallows a paragraph."""
        if plain and plain[-1].strip():
            plain.append("")
        flush()
        out.append(text)
        if after < len(lines) and lines[after].strip():
            out.append("")

    while i < len(lines):
        line = lines[i]
        m = None if in_math else FENCE.match(line)
        if m:
            char, size = m.group("fence")[0], len(m.group("fence"))
            directive = DIRECTIVE.match(m.group("info"))
            closing = re.compile(r"^ {0,3}" + re.escape(char) + "{" + str(size) + r",}\s*$")
            end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), len(lines))
            body = lines[i + 1 : end]
            if directive:
                block(convert_directive(book, doc, directive.group("name"), directive.group("arg"), body), end + 1)
            elif char == ":":  # a colon fence without a directive name: MyST shows its content
                block(convert_blocks(book, doc, "\n".join(body)), end + 1)
            else:
                flush()
                out.append("\n".join(lines[i : end + 1]))  # a code block: verbatim
            i = end + 1
            continue
        stripped = line.strip()
        if not in_math and (re.match(r"^\([^()\s]+\)=\s*$", stripped) or line.startswith("%") or stripped == "+++"):
            i += 1  # a label target, a MyST comment, a block break: nothing to show
            continue
        begin = re.match(r"^\\begin\{(\w+\*?)\}", stripped)
        if begin and not in_math:  # a bare amsmath environment: Colab's MathJax renders it inside $$
            env = begin.group(1)
            end = next((j for j in range(i, len(lines)) if f"\\end{{{env}}}" in lines[j]), None)
            if end is None:
                raise ConversionError(f"{doc}: \\begin{{{env}}} without \\end{{{env}}}")
            block("$$\n" + "\n".join(lines[i : end + 1]) + "\n$$", end + 1)
            i = end + 1
            continue
        if in_math or line.count("$$") >= 2:  # `$$ ... $$ (label)`: the label is for the book's references
            line = re.sub(r"\$\$\s*\([^()\s]+\)\s*$", "$$", line)
        in_math ^= line.count("$$") % 2 == 1
        plain.append(line)
        i += 1
    flush()
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- cells

FOLDED_TAGS = ("hide-cell", "hide-input", "remove-input")
INTERACTIVE = 'class="sdpa-interactive"'  # the wrapper of lib.interactive's snippet


def interactive_outputs(cell: dict) -> list[dict]:
    """The interactive figures among a code cell's stored outputs, as Colab can show them without a run: the
    snippet (which loads Vega from the web where the page has none) and its text; the PNG first frame is dropped."""
    alt = cell.get("metadata", {}).get("mystnb", {}).get("image", {}).get("alt", "")
    kept = []
    for output in cell.get("outputs", []):
        data = output.get("data", {})
        html = data.get("text/html", "")
        html = html if isinstance(html, str) else "".join(html)
        if output.get("output_type") not in ("display_data", "execute_result") or INTERACTIVE not in html:
            continue
        if alt:
            label = alt.replace("&", "&amp;").replace('"', "&quot;").replace("<", "&lt;")
            html = html.replace(INTERACTIVE, f'{INTERACTIVE} role="group" aria-label="{label}"', 1)
        plain = data.get("text/plain", "")
        kept.append({"output_type": "display_data", "metadata": {},
                     "data": {"text/html": as_lines(html), "text/plain": plain if isinstance(plain, list) else as_lines(plain)}})
    return kept


def is_glue_only(code: str) -> bool:
    """A cell whose every statement is a bare glue(...) call: it exists only to feed the book's prose."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    calls = [s for s in tree.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]
    names = [getattr(c.value.func, "id", getattr(c.value.func, "attr", "")) for c in calls]
    return bool(tree.body) and len(calls) == len(tree.body) and all(n == "glue" for n in names)


def fold_title(cell: dict, exercise: int | None, in_exercises: bool, aside: str | None = None) -> str:
    """The title Colab shows on a folded cell: from its role tag (lib.notebook.ROLES), as the book's fold says it."""
    tags = cell.get("metadata", {}).get("tags", [])
    if "solution" in tags or in_exercises:
        return f"Solution to exercise {exercise} (double-click to show)" if exercise else "Solution (double-click to show)"
    if "check" in tags:
        return "The checks (double-click to show)"
    if "plot" in tags:
        return "Plotting code (double-click to show)"
    if "deeper" in tags:
        return f"{aside or 'Going deeper'} (double-click to show the code)"
    prompt = cell.get("metadata", {}).get("mystnb", {}).get("code_prompt_show", "")
    if prompt and not prompt.startswith("Show code cell"):  # the book's own prompt, "Show the table helper"
        shown = re.sub(r"^Show\s+", "", prompt)
        return shown[:1].upper() + shown[1:] + " (double-click to show)"
    code = source(cell)
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    if first.startswith("#") and not first.startswith("#!"):
        return first.lstrip("# ").rstrip(".") + " (double-click to show the code)"
    return "Code hidden in the book (double-click to show)"


def caption_cell(book: Book, doc: str, cell: dict) -> dict | None:
    """The numbered caption the book prints under a figure cell, as a Markdown cell to follow it in Colab."""
    name = cell.get("metadata", {}).get("mystnb", {}).get("figure", {}).get("name")
    if name not in book.figures:
        return None
    _, number, caption = book.figures[name]
    text = convert_blocks(book, doc, f"**{figure_label(book, number)}:** {caption}".strip())
    return {"cell_type": "markdown", "id": f"{cell.get('id')}-caption", "metadata": {}, "source": as_lines(text)}


ASIDE_TITLE = re.compile(r"^ {0,3}(?:`{3,}|:{3,})\s*\{admonition\}\s*(Going deeper.*?)\s*$", re.MULTILINE)


def banner(book: Book, doc: str, title: str, nb: dict, raising: bool, folded: bool) -> str:
    kind = "a chapter" if doc.startswith("chapters/") else "a page"
    lines = [
        f"> **Colab edition** of [{title}]({book.page_url(doc)}), {kind} of *{book.title}*.",
        "> Run the cells from the top: the first code cell fetches the course library with `git clone` and installs",
        "> nothing. The numbers in the text come from the book's own run; timings on your runtime will differ.",
    ]
    if folded:
        lines.append("> Folded cells (checks, plotting code, solutions) open with a double-click.")
    if nb.get("metadata", {}).get("accelerator") == "GPU":
        lines += [">", "> This chapter asks Colab for a GPU runtime. If you got a CPU, choose *Runtime → Change runtime type*."]
    if raising:
        lines += [">", "> Some cells stop with an error on purpose, and their first line says so: the error is the lesson.",
                  "> *Run all* halts there; carry on from the cell below."]
    return "\n".join(lines)


def as_lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def convert_notebook(book: Book, path: pathlib.Path) -> dict:
    doc = docname(book, path)
    nb = read_notebook(path)
    cells, in_exercises, exercise, title, aside = [], False, None, None, None
    raising = False
    for cell in nb["cells"]:
        text = source(cell)
        tags = cell.get("metadata", {}).get("tags", [])
        new = {"cell_type": cell["cell_type"], "id": cell.get("id"), "metadata": {}}
        if tags:
            new["metadata"]["tags"] = list(tags)
        if cell.get("attachments"):
            new["attachments"] = cell["attachments"]
        if cell["cell_type"] == "markdown":
            for line in text.splitlines():
                if line.startswith("# ") and title is None:
                    title = line[2:].strip()
                if re.match(r"^#{1,2} ", line):
                    in_exercises = line.lstrip("# ").strip().lower().startswith("exercise")
                    exercise, aside = None, None
                numbered = re.match(r"^\*\*(\d+)[.)]", line)
                if numbered and in_exercises:
                    exercise = int(numbered.group(1))
            asides = ASIDE_TITLE.findall(text)
            aside = convert_inline(book, doc, asides[-1]).replace("`", "") if asides else aside
            text = convert_blocks(book, doc, text)
        elif cell["cell_type"] == "code":
            if "remove-cell" in tags and is_glue_only(text):
                continue  # book-only plumbing: nothing for a Colab reader
            if "raises-exception" in tags:
                raising = True
                text = "# This cell stops with an error on purpose: the error is the lesson.\n" + text
            if any(tag in tags for tag in FOLDED_TAGS):  # Colab reads a form title on the first line only
                text = f"# @title {fold_title(cell, exercise, in_exercises, aside)}\n" + text
                new["metadata"]["cellView"] = "form"
            new["execution_count"] = None
            new["outputs"] = interactive_outputs(cell)
        new["source"] = as_lines(text)
        cells.append(new)
        caption = caption_cell(book, doc, cell) if cell["cell_type"] == "code" else None
        if caption:
            cells.append(caption)
    if title is None:
        raise ConversionError(f"{doc}: no '# ' title")
    folded = any(c.get("metadata", {}).get("cellView") == "form" for c in cells)
    text = banner(book, doc, title, nb, raising, folded)
    intro = {"cell_type": "markdown", "id": "colab-banner", "metadata": {}, "source": as_lines(text)}
    metadata = {
        "colab": {"provenance": [], "toc_visible": True},
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    if nb.get("metadata", {}).get("accelerator"):
        metadata["accelerator"] = nb["metadata"]["accelerator"]
    return {"cells": [intro, *cells], "metadata": metadata, "nbformat": 4, "nbformat_minor": max(5, nb.get("nbformat_minor", 5))}


def dumps(nb: dict) -> str:
    """The notebook as nbformat writes it (indent 1, sorted keys, UTF-8), so the copies diff like the chapters."""
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def build(out: pathlib.Path = OUT, root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Write the Colab copy of every notebook page (chapters/, guide/) under out/; remove copies whose page is gone."""
    book = Book(root)
    written = []
    for path in book.notebooks:
        copy = out / path.relative_to(book.root)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(dumps(convert_notebook(book, path)), encoding="utf-8")
        written.append(copy)
    for folder in ("chapters", "guide"):
        for stale in sorted((out / folder).glob("*.ipynb")):
            if stale not in written:
                stale.unlink()
    return written


def apply_setup_cell(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """Write tools/setup_cell.py into the first code cell of every notebook page whose setup cell differs; its
    outputs, tags and the rest of the notebook stay as they are. Returns the notebooks it changed."""
    import nbformat

    text = (root / "tools" / "setup_cell.py").read_text().strip()
    changed = []
    for path in [*sorted((root / "chapters").glob("*.ipynb")), *sorted((root / "guide").glob("*.ipynb"))]:
        nb = nbformat.read(path, as_version=4)
        first = next((c for c in nb.cells if c.cell_type == "code"), None)
        if first is None or "remove-cell" not in first.metadata.get("tags", []):
            raise ConversionError(f"{path.relative_to(root)}: its first code cell is not the hidden setup cell")
        if first.source.strip() != text:
            first.source = text
            nbformat.write(nb, path)
            changed.append(path)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help="folder to write into (default: colab/)")
    parser.add_argument("--setup-cell", action="store_true",
                        help="first write tools/setup_cell.py into every chapter and guide page")
    args = parser.parse_args(argv)
    try:
        for path in apply_setup_cell() if args.setup_cell else []:
            print(f"setup cell written into {path.relative_to(ROOT)}")
        written = build(args.out)
    except ConversionError as exc:
        print(f"make_colab: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path.relative_to(args.out.parent) if args.out == OUT else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
