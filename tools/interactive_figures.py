"""A Sphinx extension of the book: the interactive figures of lib/interactive.py, offline.

A chapter's interactive figure is stored as Altair's "universal" HTML snippet, which draws the chart with
vega-embed and, where the page has no Vega yet, loads it from jsDelivr. In the book nothing may leave the page's
folder, so this extension
- writes vl-convert's JavaScript bundle (Vega, Vega-Lite and vega-embed in one file) to
  ``_static/interactive/vega-bundle.js`` in the build (not in the source ``_static/``, whose every ``.js`` Jupyter Book
  puts on every page);
- adds it, and one line telling the snippets that Vega is there (``VEGA_DEBUG``, the versions the snippet checks
  before it loads anything), only to the pages that hold an interactive figure, once each;
- gives each figure its alt text: myst-nb puts the cell's ``mystnb.image.alt`` on the first frame (the PNG the
  snippet carries for readers without JavaScript), and the HTML build shows the snippet instead, so the alt text
  becomes the snippet's ``aria-label``.
`_config.yml` loads it (``sphinx.local_extensions``: ``interactive_figures: tools/``).
"""

from __future__ import annotations

import html
import pathlib

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

MARKER = 'class="sdpa-interactive"'
BUNDLE = "interactive/vega-bundle.js"


def versions() -> dict[str, str]:
    """What the snippets check in VEGA_DEBUG before loading Vega: Altair's versions, which the bundle must match."""
    import altair as alt
    import vl_convert

    bundle = {"vega": vl_convert.get_vega_version(), "vegaembed": vl_convert.get_vega_embed_version()}
    for name, wanted in (("vega", alt.VEGA_VERSION), ("vegaembed", alt.VEGAEMBED_VERSION)):
        if bundle[name].split(".")[0] != wanted.split(".")[0]:
            raise RuntimeError(f"vl-convert bundles {name} {bundle[name]}; Altair's snippets ask for {wanted}")
    lite = ".".join(alt.VEGALITE_VERSION.split(".")[:2])
    if lite not in vl_convert.get_vegalite_versions():
        raise RuntimeError(f"vl-convert has no Vega-Lite {lite}, which Altair {alt.__version__} writes")
    return {"vega_version": alt.VEGA_VERSION, "vegalite_version": alt.VEGALITE_VERSION,
            "vegaembed_version": alt.VEGAEMBED_VERSION}


def bundle_text() -> str:
    import altair as alt
    import vl_convert

    lite = ".".join(alt.VEGALITE_VERSION.split(".")[:2])
    # The bundle declares its names at the top level (`const n`, `_`, ...), where they would clash with the page's
    # own scripts; inside a function only the globals it assigns (window.vegaEmbed, vega, vegaLite) come out.
    return "(function () {\n" + vl_convert.javascript_bundle(vl_version=lite) + "\n})();\n"


def write_bundle(app):
    if app.builder.format != "html":
        return
    path = pathlib.Path(app.outdir) / "_static" / BUNDLE
    text = bundle_text()
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


class AltText(SphinxPostTransform):
    """Before myst-nb picks one output per builder (its priority 4), copy the first frame's alt to the snippet."""

    default_priority = 3
    formats = ("html",)

    def run(self, **kwargs):
        for bundle in list(self.document.findall(nodes.container)):
            if bundle.get("nb_element") != "mime_bundle":
                continue
            raws = [n for n in bundle.findall(nodes.raw) if MARKER in n.astext()]
            alts = [n.get("alt") for n in bundle.findall(nodes.image) if n.get("alt")]
            for raw in raws:
                if alts:
                    label = html.escape(alts[0], quote=True)
                    text = raw.astext().replace(MARKER, f'{MARKER} role="group" aria-label="{label}"', 1)
                    raw.children = [nodes.Text(text)]
                    raw.rawsource = text


def add_scripts(app, pagename, templatename, context, doctree):
    if doctree is None or not any(MARKER in n.astext() for n in doctree.findall(nodes.raw)):
        return
    app.add_js_file(BUNDLE, priority=400)
    flags = ", ".join(f'{key}: "{value}"' for key, value in versions().items())
    app.add_js_file(None, body=f"var VEGA_DEBUG = {{{flags}}};", priority=401)


def setup(app):
    app.connect("builder-inited", write_bundle)
    app.connect("html-page-context", add_scripts)
    app.add_post_transform(AltText)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
