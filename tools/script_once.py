"""A Sphinx extension of the book: each script once per page.

Under jupyter-book 1, sphinx-thebe's inline configuration script (and sphinx-togglebutton's) reaches every page
twice, with two priorities, so the browser reports "Identifier 'THEBE_JS_URL' has already been declared". This
keeps the first of two scripts with the same source and attributes. `_config.yml` loads it (local_extensions).
"""


def keep_first(app, pagename, templatename, context, doctree):
    seen, kept = set(), []
    for script in context.get("script_files", []):
        filename = getattr(script, "filename", script) or ""  # an inline script has None or ""
        key = (str(filename), tuple(sorted(getattr(script, "attributes", {}).items())))
        if key not in seen:
            seen.add(key)
            kept.append(script)
    context["script_files"] = kept


def setup(app):
    app.connect("html-page-context", keep_first, priority=900)  # after the extensions have added theirs
    return {"parallel_read_safe": True, "parallel_write_safe": True}
