// labkit's live figure (widgets/live.py): every view draws the widget's whole figure, the
// `_figure` trait, with Plotly.react, one draw after another. No edit messages: a view made at
// any time draws the figure as it is now, and a change that arrives while a view is still
// drawing waits for that draw.
//
// plotly.js is not part of this module: anywidget gives a model 2 s to load its module and
// drops every later state update of a model that missed that (its comm handler awaits the
// load), and a module carrying plotly's 4.6 MB missed it on a loaded machine. The source is
// the `source` trait of one PlotlyLibrary model per kernel (`_plotly` names it), evaluated once
// per page in a scope where `module`, `exports` and `define` are undefined, so its UMD wrapper
// always sets globalThis.Plotly.
function plotly(model) {
  if (globalThis.Plotly) return Promise.resolve(globalThis.Plotly);
  if (!globalThis.labkitPlotly) {
    globalThis.labkitPlotly = model.widget_manager.get_model(model.get("_plotly")).then((library) => {
      if (!globalThis.Plotly) {
        (0, eval)("(function (module, exports, define) {\n" + library.get("source") + "\n}).call(globalThis)");
      }
      return globalThis.Plotly;
    });
    // a failed load (the library's model not there yet) is tried again by the next view
    globalThis.labkitPlotly.catch(() => delete globalThis.labkitPlotly);
  }
  return globalThis.labkitPlotly;
}

export default {
  render({ model, el }) {
    el.classList.add("labkit-figure");
    let Plotly = null;
    let chain = plotly(model).then((loaded) => {
      Plotly = loaded;
    });
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
          if (Plotly && !fixedWidth && full && el.clientWidth > 0 && Math.abs(full.width - el.clientWidth) > 1) {
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
      if (Plotly) Plotly.purge(el);
    };
  },
};
