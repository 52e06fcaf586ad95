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
- on a column narrower than a figure (a phone), draws a row of its panels a little smaller, or stacks it, before
  Vega draws it (see STACK_ON_A_PHONE); `_static/custom.css` scales what is still wider to the column, and keeps
  the controls, which come first, in view while the picture scrolls under them;
- in the book's dark mode, draws the figure in the dark colours its spec carries (and again when the reader
  switches the theme);
- for a reader without scripts, shows the figure's first frame, the PNG the notebook stores, in <noscript>.
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

# Run after vl-convert's bundle, before any snippet draws: vegaEmbed, wrapped,
# - lays a figure out for a column narrower than it (a phone): a row of panels (hconcat) too wide for the column is
#   drawn smaller where a little is enough (down to SHRINK of its size: a row of two plots stays a row), and is
#   stacked (hconcat -> vconcat) otherwise; no panel is wider than the column less 80 px for its axis, and a line of
#   text (a left-aligned text mark) breaks between its clauses. The width of a row is estimated from its panels'
#   widths, plus AXIS px for each panel's axis and the spacing between them;
# - in the book's dark mode (data-theme="dark" on <html>, which the theme sets before the page draws), swaps the
#   figure's colours and adds the configuration the spec carries for it (usermeta.dark, lib/interactive.py), and
#   draws each figure again, its controls where the reader left them, when the reader switches the theme.
# Only the layout and the colours change: the data, the marks and the controls are those of the spec.
NARROW = 576
STACK_ON_A_PHONE = """(function () {
  var embed = window.vegaEmbed;
  if (typeof embed !== "function") return;
  var AXIS = 50, SPACING = 20, SHRINK = 0.7;
  // a comma followed by no ")" before the next "(": a line of text breaks between its clauses, not inside a tuple
  var clauses = {expr: "regexp(', (?![^(]*[)])')"};
  function width(spec) {
    if (Array.isArray(spec.hconcat)) {
      return spec.hconcat.reduce(function (sum, part) { return sum + width(part); }, 0)
        + SPACING * (spec.hconcat.length - 1);
    }
    if (Array.isArray(spec.vconcat)) return Math.max.apply(null, spec.vconcat.map(width));
    if (typeof spec.width === "number") return spec.width + AXIS;
    if (spec.width && spec.width.step) return 8 * spec.width.step + AXIS;
    if (Array.isArray(spec.layer)) return Math.max.apply(null, spec.layer.map(width));
    return 100 + AXIS;
  }
  function scaled(spec, factor) {
    var out = Object.assign({}, spec);
    ["width", "height"].forEach(function (key) {
      if (typeof out[key] === "number") out[key] = Math.floor(out[key] * factor);
    });
    return out;
  }
  function fit(spec, column) {
    if (Array.isArray(spec)) return spec.map(function (part) { return fit(part, column); });
    if (spec === null || typeof spec !== "object") return spec;
    var out = {};
    Object.keys(spec).forEach(function (key) {
      var value = spec[key];
      if (key === "datasets" || key === "data" || key === "usermeta") out[key] = value;
      else if (key === "width" && typeof value === "number") out[key] = Math.min(value, column - 80);
      else if (key === "hconcat" && Array.isArray(value)) {
        var wide = width(spec), fixed = AXIS * value.length + SPACING * (value.length - 1);
        var factor = (column - fixed) / Math.max(1, wide - fixed);
        if (wide <= column) out[key] = value;
        else if (factor >= SHRINK) out[key] = value.map(function (part) { return scaled(part, factor); });
        else out.vconcat = fit(value, column);
      } else out[key] = fit(value, column);
    });
    var mark = out.mark;
    if (mark && mark.type === "text" && mark.align === "left" && !mark.lineBreak) {
      out.mark = Object.assign({}, mark, {lineBreak: clauses});
    }
    return out;
  }
  function columnOf(el) {
    var column = el.closest ? el.closest(".sdpa-interactive") : null;
    return (column || el).getBoundingClientRect().width || window.innerWidth;
  }
  function dark() { return document.documentElement.dataset.theme === "dark"; }
  function recoloured(node, colours) {
    if (Array.isArray(node)) return node.map(function (part) { return recoloured(part, colours); });
    if (typeof node === "string") {
      Object.keys(colours).forEach(function (from) { node = node.split(from).join(colours[from]); });
      return node;
    }
    if (node === null || typeof node !== "object") return node;
    var out = {};
    Object.keys(node).forEach(function (key) {
      out[key] = key === "datasets" || key === "data" ? node[key] : recoloured(node[key], colours);
    });
    return out;
  }
  function merged(base, extra) {
    var out = Object.assign({}, base);
    Object.keys(extra).forEach(function (key) {
      var a = out[key], b = extra[key];
      out[key] = a && typeof a === "object" && b && typeof b === "object" && !Array.isArray(b) ? merged(a, b) : b;
    });
    return out;
  }
  function themed(spec) {
    var scheme = spec.usermeta && spec.usermeta.dark;
    if (!scheme || !dark()) return spec;
    var colours = {};
    Object.keys(scheme.colours).forEach(function (from) {
      colours[from] = scheme.colours[from];
      colours[from.toLowerCase()] = scheme.colours[from];
    });
    var out = recoloured(spec, colours);
    out.config = merged(out.config || {}, scheme.config);
    return out;
  }
  function laidOut(el, spec) {
    var column = columnOf(el), figure = el.closest ? el.closest(".sdpa-interactive") : null;
    // the figure's card is dark (custom.css) only where the figure is drawn in dark colours: one stored before
    // lib/interactive.py gave its spec dark colours stays on a light card
    if (figure) figure.classList.toggle("sdpa-dark", !!(spec.usermeta && spec.usermeta.dark) && dark());
    return themed(column < NARROW_PX ? fit(spec, column) : spec);
  }
  var drawn = [];
  var wrapped = function (el, spec, options) {
    var target = typeof el === "string" ? document.querySelector(el) : el;
    if (!target || typeof spec !== "object") return embed(el, spec, options);
    var entry = {target: target, spec: spec, options: options};
    entry.result = embed(target, laidOut(target, spec), options);
    drawn.push(entry);
    return entry.result;
  };
  // the reader switched the theme: each figure is drawn again in it, its controls where they were
  var theme = document.documentElement.dataset.theme;
  new MutationObserver(function () {
    if (document.documentElement.dataset.theme === theme) return;
    theme = document.documentElement.dataset.theme;
    drawn.forEach(function (entry) {
      entry.result = entry.result.then(function (result) {
        var spec = Object.assign({}, entry.spec);
        spec.params = (entry.spec.params || []).map(function (param) {
          if (!param.bind) return param;
          try { return Object.assign({}, param, {value: result.view.signal(param.name)}); }
          catch (error) { return param; }
        });
        result.finalize();
        return embed(entry.target, laidOut(entry.target, spec), entry.options);
      });
    });
  }).observe(document.documentElement, {attributes: true, attributeFilter: ["data-theme"]});
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
    """Before myst-nb picks one output per builder (its priority 4), label the snippet (see label), and give it its
    first frame for a reader without scripts (see first_frame)."""

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
                first_frame(bundle, raw)


def first_frame(bundle, raw):
    """Without scripts (JavaScript off, a reader that strips them) the snippet draws nothing: the figure's first
    frame, the PNG the notebook stores beside it (its image node, with the cell's alt text, which describes that
    frame), goes at the end of the figure's wrapper inside <noscript>, where a page that runs scripts neither shows
    nor fetches it.
    The image node is copied from the PNG's output, which myst-nb then drops: Sphinx copies the file to _images."""
    images = [image for child in bundle.children
              if isinstance(child, nodes.container) and child.get("mime_type") == "image/png"
              for image in child.findall(nodes.image)]
    if not images:  # a figure drawn without vl-convert stores no first frame
        return
    image = images[0].deepcopy()
    image["classes"] = [*image.get("classes", []), "sdpa-first-frame"]
    text = raw.astext()
    end = text.rstrip().rfind("</div>")  # the wrapper's end: the first frame goes inside the figure's group
    if end < 0:
        return
    # the raw node writes its own <div> with its classes (myst-nb's "output text_html") around its text: that div is
    # written out here instead, so that it closes after the first frame
    classes, raw["classes"] = raw.get("classes", []), []
    opening = f'<div class="{" ".join(classes)}">' if classes else ""
    closing = "</div>" if classes else ""
    raw.children = [nodes.Text(opening + text[:end])]
    raw.rawsource = opening + text[:end]
    parent = raw.parent
    at = parent.index(raw) + 1
    for offset, node in enumerate([nodes.raw("", "<noscript>", format="html"), image,
                                   nodes.raw("", "</noscript>" + text[end:] + closing, format="html")]):
        parent.insert(at + offset, node)


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
