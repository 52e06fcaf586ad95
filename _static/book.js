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
