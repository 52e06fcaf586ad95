"""A Sphinx extension of the book: the interactive figures of lib/interactive.py, offline.

A chapter's interactive figure is stored as Altair's "universal" HTML snippet, which draws the chart with
vega-embed and, where the page has no Vega yet, loads it from jsDelivr. In the book nothing may leave the page's
folder, so this extension
- writes vl-convert's JavaScript bundle (Vega, Vega-Lite and vega-embed in one file) to
  ``_static/interactive/vega-bundle.js`` in the build (not in the source ``_static/``, whose every ``.js`` Jupyter Book
  puts on every page);
- adds it, and one line telling the snippets that Vega is there (``VEGA_DEBUG``, the versions the snippet checks
  before it loads anything), only to the pages that hold an interactive figure, once each;
- gives each figure a label that stays true while its control moves: the snippet's ``aria-label`` names the
  figure (its number and caption) and its control (from the figure's one-line text/plain, "<interactive figure
  NAME: CONTROL>"). The cell's ``mystnb.image.alt`` describes the first frame only, so it stays on that frame (the
  PNG for readers without JavaScript) and is not copied to the snippet, which would keep describing the first
  frame after the control moved;
- on a column narrower than a figure (a phone), stacks the figure's side-by-side panels before Vega draws it
  (every ``hconcat`` of the spec becomes a ``vconcat``); `_static/custom.css` scales what is still wider to the
  column.
`_config.yml` loads it (``sphinx.local_extensions``: ``interactive_figures: tools/``).
"""

from __future__ import annotations

import html
import pathlib
import re

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


CONTROL = re.compile(r"^<interactive figure [^:>]+: (.+)>$")

# Run after vl-convert's bundle, before any snippet draws: vegaEmbed, wrapped, lays a figure out for a column
# narrower than NARROW px (a phone; the widest figure is about 730 px): its panels stacked (hconcat -> vconcat),
# no panel wider than the column less 80 px for its axis, and a line of text (a left-aligned text mark) broken
# between its clauses. Only the layout changes: the data, the marks and the controls are those of the spec.
NARROW = 576
STACK_ON_A_PHONE = """(function () {
  var embed = window.vegaEmbed;
  if (typeof embed !== "function") return;
  // a comma followed by no ")" before the next "(": a line of text breaks between its clauses, not inside a tuple
  var clauses = {expr: "regexp(', (?![^(]*[)])')"};
  function stack(spec, widest) {
    if (Array.isArray(spec)) return spec.map(function (part) { return stack(part, widest); });
    if (spec === null || typeof spec !== "object") return spec;
    var out = {};
    Object.keys(spec).forEach(function (key) {
      var value = spec[key];
      if (key === "datasets" || key === "data") out[key] = value;
      else if (key === "width" && typeof value === "number") out[key] = Math.min(value, widest);
      else out[key === "hconcat" ? "vconcat" : key] = stack(value, widest);
    });
    var mark = out.mark;
    if (mark && mark.type === "text" && mark.align === "left" && !mark.lineBreak) {
      out.mark = Object.assign({}, mark, {lineBreak: clauses});
    }
    return out;
  }
  function stacked(el, spec) {
    var column = el.closest ? el.closest(".sdpa-interactive") : null;
    var width = (column || el).getBoundingClientRect().width || window.innerWidth;
    return width < NARROW_PX ? stack(spec, Math.max(160, width - 80)) : spec;
  }
  var wrapped = function (el, spec, options) {
    var target = typeof el === "string" ? document.querySelector(el) : el;
    return embed(el, target && typeof spec === "object" ? stacked(target, spec) : spec, options);
  };
  Object.keys(embed).forEach(function (key) { wrapped[key] = embed[key]; });
  window.vegaEmbed = wrapped;
})();""".replace("NARROW_PX", str(NARROW))


def label(bundle, env, docname) -> str:
    """The figure's static label: "Interactive figure N.M: <caption> Control: <its control>."."""
    plain = [c.astext().strip() for c in bundle.children
             if isinstance(c, nodes.container) and c.get("mime_type") == "text/plain"]
    found = CONTROL.match(plain[0]) if plain else None
    control = found.group(1) if found else "the control under it"
    figure, number, caption = bundle.parent, "", ""
    while figure is not None and not isinstance(figure, nodes.figure):
        figure = figure.parent
    if figure is not None:
        captions = list(figure.findall(nodes.caption))
        caption = " ".join(captions[0].astext().split()) if captions else ""
        numbers = getattr(env, "toc_fignumbers", {}).get(docname, {}).get("figure", {})
        for name in figure.get("ids", []):
            if name in numbers:
                number = " " + ".".join(map(str, numbers[name]))
                break
    text = f"Interactive figure{number}: {caption}" if caption else f"Interactive figure{number}."
    if not text.endswith((".", ":")):
        text += "."
    return f"{text} Control: {control}; the picture and the line under it follow it."


class AltText(SphinxPostTransform):
    """Before myst-nb picks one output per builder (its priority 4), label the snippet (see label)."""

    default_priority = 3
    formats = ("html",)

    def run(self, **kwargs):
        for bundle in list(self.document.findall(nodes.container)):
            if bundle.get("nb_element") != "mime_bundle":
                continue
            raws = [n for n in bundle.findall(nodes.raw) if MARKER in n.astext()]
            for raw in raws:
                text = html.escape(label(bundle, self.env, self.env.docname), quote=True)
                text = raw.astext().replace(MARKER, f'{MARKER} role="group" aria-label="{text}"', 1)
                raw.children = [nodes.Text(text)]
                raw.rawsource = text


def add_scripts(app, pagename, templatename, context, doctree):
    if doctree is None or not any(MARKER in n.astext() for n in doctree.findall(nodes.raw)):
        return
    app.add_js_file(BUNDLE, priority=400)
    flags = ", ".join(f'{key}: "{value}"' for key, value in versions().items())
    app.add_js_file(None, body=f"var VEGA_DEBUG = {{{flags}}};", priority=401)
    app.add_js_file(None, body=STACK_ON_A_PHONE, priority=402)


def setup(app):
    app.connect("builder-inited", write_bundle)
    app.connect("html-page-context", add_scripts)
    app.add_post_transform(AltText)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
