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
// indentation, not at the left edge, each line of a code block (a code cell's input, a code listing; never a
// printed output) goes into a span.code-line that records its leading spaces in --indent; the CSS gives the span a
// hanging indent of that many columns plus four. On a wider screen the spans are inline and change nothing: the
// text, and so what the copy button copies, is the same.
function hangingIndents(pre) {
  if (pre.dataset.lines || pre.closest(".cell_output")) {
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

// The scroll cue of a printed output on a phone (_static/custom.css): a pre whose lines run past its right edge
// gets the class scrolls-on until the reader has scrolled it to the end.
function markScrolling() {
  document.querySelectorAll("article .cell_output pre").forEach((pre) => {
    const more = pre.scrollWidth - pre.clientWidth - pre.scrollLeft > 1;
    pre.classList.toggle("scrolls-on", more);
    if (!pre.dataset.cue) {
      pre.dataset.cue = "1";
      pre.addEventListener("scroll", () => {
        pre.classList.toggle("scrolls-on", pre.scrollWidth - pre.clientWidth - pre.scrollLeft > 1);
      }, {passive: true});
    }
  });
}
window.addEventListener("load", markScrolling);
window.addEventListener("resize", markScrolling);
document.addEventListener("toggle", markScrolling, true); // a fold opened: its outputs are laid out now
