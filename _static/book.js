// The book's own behaviour on top of the theme (pydata-sphinx-theme 0.16): on a phone, the menu and the contents
// open as drawers (<dialog> elements); a tap on a link in one jumps to the section and closes the drawer, instead of
// leaving it over the page.
document.addEventListener("click", (event) => {
  const link = event.target.closest && event.target.closest("a[href]");
  const drawer = link && link.closest("dialog[open]");
  if (drawer && /^pst-.*sidebar-modal$/.test(drawer.id)) {
    drawer.close();
  }
});

// On a phone a long line of code wraps (_static/custom.css). So that a wrapped line continues under its own
// indentation, not at the left edge, each line of a code block (a code cell's input, a code listing, a printed
// output that wraps: see classifyOutputs) goes into a span.code-line that records its leading spaces in --indent;
// the CSS gives the span a hanging indent of that many columns plus four. On a wider screen the spans are inline and change nothing: the
// text, and so what the copy button copies, is the same.
function hangingIndents(pre, output = false) {
  if (pre.dataset.lines || (pre.closest(".cell_output") && !output)) {
    return;
  }
  const lines = [[]];
  for (const node of pre.childNodes) {
    const isText = node.nodeType === Node.TEXT_NODE;
    if (!isText && node.nodeType !== Node.ELEMENT_NODE) {
      continue;
    }
    if (!isText && node.children.length && node.textContent.includes("\n")) {
      return; // a nested element across lines: leave this block as it is
    }
    node.textContent.split("\n").forEach((part, k) => {
      if (k > 0) {
        lines.push([]);
      }
      if (part) {
        const piece = isText ? document.createTextNode(part) : node.cloneNode(!node.textContent.includes("\n"));
        if (!isText && node.textContent.includes("\n")) {
          piece.textContent = part;
        }
        lines[lines.length - 1].push(piece);
      }
    });
  }
  const ends = pre.textContent.endsWith("\n");
  if (ends && lines.length > 1 && !lines[lines.length - 1].length) {
    lines.pop();
  }
  const spans = lines.map((nodes, k) => {
    const span = document.createElement("span");
    span.className = "code-line";
    const text = nodes.map((n) => n.textContent).join("");
    const indent = text.match(/^[ \t]*/)[0].replace(/\t/g, "    ").length;
    if (indent) {
      span.style.setProperty("--indent", `${indent}ch`);
    }
    span.append(...nodes);
    if (k < lines.length - 1 || ends) {
      span.append("\n");
    }
    return span;
  });
  pre.replaceChildren(...spans);
  pre.dataset.lines = String(spans.length);
}

function hangAllIndents() {
  document.querySelectorAll("article div.cell_input pre, article div.highlight pre").forEach(hangingIndents);
}
if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", hangAllIndents);
} else {
  hangAllIndents();
}

// A printed output on a phone (_static/custom.css) is a table, which keeps its lines (its type shrinks to fit, and
// what is still wider scrolls with a cue), or anything else, which wraps like code. Which it is follows from its
// text, so it is decided once, before layout, for the outputs inside closed folds too: a table has two lines or
// more and columns (a run of two spaces between two characters, or a rule of dashes), or is a NumPy matrix (two
// lines or more that open with "["); printed source code (two lines or more of comments, def, for, if, return, a
// decorator, an assignment, or a diff's +/-) wraps, even where its comments line up, and so does a traceback.
const TABLE_LINE = /\S {2,}\S|^[-=─━]{10,}\s*$/;
const MATRIX_LINE = /^\s*\[/;
const CODE_LINE = /^\s*(#|def |class |for |if |while |return\b|@\w|[A-Za-z_][\w.]*(\[[^\]]*\])? = [^\s=])|^[+-] {2,}\S/;

function outputKind(text) {
  const lines = text.replace(/\n+$/, "").split("\n");
  const count = (pattern) => lines.filter((line) => pattern.test(line)).length;
  if (lines.length < 2 || count(CODE_LINE) >= 2) {
    return "wraps";
  }
  return count(TABLE_LINE) >= 1 || count(MATRIX_LINE) >= 2 ? "table" : "wraps";
}

function classifyOutputs() {
  document.querySelectorAll("article .cell_output pre").forEach((pre) => {
    if (pre.dataset.kind) {
      return;
    }
    const kind = pre.closest(".output.traceback") ? "wraps" : outputKind(pre.textContent);
    pre.dataset.kind = kind;
    pre.classList.add(`output-${kind}`);
    if (kind === "table") {
      const longest = Math.max(...pre.textContent.split("\n").map((line) => line.length));
      pre.style.setProperty("--cols", String(Math.max(longest, 1)));
    } else {
      hangingIndents(pre, true);
    }
  });
}

// A Markdown table wider than the column scrolls inside its box (the theme's .pst-scrollable-table-container); while
// there is more to its right, the box has the class scrolls-on, and _static/custom.css fades its right edge. A box
// that scrolls, a Markdown table's or a printed table's, takes the keyboard's focus, so that the arrow keys scroll
// it (WCAG 2.1.1); one that fits is no stop for the Tab key. A box in a closed fold has no width yet: it is seen
// again when the fold opens (a ResizeObserver sees it take its size).
function markScrolling(box) {
  if (!box.getBoundingClientRect().width) {
    return;
  }
  const table = box.matches(".pst-scrollable-table-container");
  if (table) {
    box.classList.toggle("scrolls-on", box.scrollWidth - box.clientWidth - box.scrollLeft > 1);
  }
  if (box.scrollWidth > box.clientWidth + 1) {
    box.setAttribute("tabindex", "0");
  } else if (!table) {
    box.removeAttribute("tabindex");
  }
}

function watchScrolling() {
  const seen = new ResizeObserver((entries) => entries.forEach((entry) => markScrolling(entry.target)));
  document.querySelectorAll("article .pst-scrollable-table-container, article .cell_output pre").forEach((box) => {
    markScrolling(box);
    seen.observe(box);
    if (box.matches(".pst-scrollable-table-container")) {
      box.addEventListener("scroll", () => markScrolling(box), {passive: true});
    }
  });
}
window.addEventListener("load", watchScrolling);

// A display formula wider than its column is drawn smaller until it fits, down to half its size (MathJax 3 sets
// each formula's size on its mjx-container, in which everything else is measured in em). A formula in a closed fold
// has no width yet: it is fitted when the fold opens (a ResizeObserver sees it take its size).
function fitFormulas() {
  document.querySelectorAll("article mjx-container[display='true']").forEach((math) => {
    const box = math.parentElement;
    if (!box || !math.getBoundingClientRect().width) {
      return;
    }
    if (!math.dataset.size) {
      math.dataset.size = getComputedStyle(math).fontSize;
    }
    const size = parseFloat(math.dataset.size);
    math.style.fontSize = math.dataset.size;
    const room = box.clientWidth, wide = math.scrollWidth;
    if (wide > room + 1) {
      math.style.fontSize = `${Math.max(0.5, (room - 2) / wide) * size}px`;
    }
  });
}

function whenTypeset() {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    MathJax.startup.promise.then(() => {
      fitFormulas();
      const seen = new ResizeObserver(fitFormulas);
      document.querySelectorAll("article mjx-container[display='true']").forEach((math) => seen.observe(math));
    });
  }
}

if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", classifyOutputs);
} else {
  classifyOutputs();
}
window.addEventListener("load", whenTypeset);
window.addEventListener("resize", fitFormulas);

// A Going-deeper aside or a written solution is a dropdown whose button sphinx-togglebutton's script makes, named
// "Toggle hidden content" on every one. The button is named after the title it opens instead ("Going deeper: ...",
// "Solution"), so a screen-reader user can tell the folds apart; aria-expanded still says whether it is open. (The
// cells' folds are named in the HTML the build writes: tools/accessible_names.py.) The script registered its own
// DOMContentLoaded handler first, so the buttons exist when this runs.
function nameToggleButtons() {
  document.querySelectorAll("article .admonition-title > button.toggle-button").forEach((button) => {
    const title = button.parentElement.textContent.replace(/\s+/g, " ").trim();
    if (title) {
      button.setAttribute("aria-label", title);
    }
  });
}
if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", nameToggleButtons);
} else {
  nameToggleButtons();
}
