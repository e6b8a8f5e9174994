// labkit's live figure (widgets/live.py): every view draws the widget's whole figure, the
// `_figure` trait, with Plotly.react, one draw after another. No edit messages: a view made at
// any time draws the figure as it is now, and a change that arrives while a view is still
// drawing waits for that draw. plotly.js is evaluated once per page (PLOTLY_SOURCE, inlined by
// live.py), in a scope where `module`, `exports` and `define` are undefined, so its UMD wrapper
// always sets globalThis.Plotly.
function plotly() {
  if (!globalThis.Plotly) {
    (0, eval)("(function (module, exports, define) {\n" + PLOTLY_SOURCE + "\n}).call(globalThis)");
  }
  return globalThis.Plotly;
}

export default {
  render({ model, el }) {
    const Plotly = plotly();
    el.classList.add("labkit-figure");
    let chain = Promise.resolve();
    let drawn = null;
    let fixedWidth = false;
    const draw = () => {
      chain = chain
        .then(() => {
          const text = model.get("_figure"); // the newest figure when this draw's turn comes
          if (text === drawn) return;
          drawn = text;
          const fig = JSON.parse(text);
          fixedWidth = Boolean(fig.layout && fig.layout.width);
          return Plotly.react(el, fig.data || [], fig.layout || {}, { displaylogo: false });
        })
        .catch((e) => console.error("labkit figure:", e));
    };
    // A figure drawn while its cell was not laid out yet (off screen, still attaching) took
    // plotly's default width: size it to its cell as soon as the cell has one.
    const resized = new ResizeObserver(() => {
      chain = chain
        .then(() => {
          const full = el._fullLayout;
          if (!fixedWidth && full && el.clientWidth > 0 && Math.abs(full.width - el.clientWidth) > 1) {
            return Plotly.Plots.resize(el);
          }
        })
        .catch(() => {});
    });
    model.on("change:_figure", draw);
    draw();
    resized.observe(el);
    return () => {
      resized.disconnect();
      model.off("change:_figure", draw);
      Plotly.purge(el);
    };
  },
};
