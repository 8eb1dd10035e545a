"""Inline BokehJS for ``jupyter_bokeh.BokehModel`` widgets, once per kernel.

What is actually needed (checked against bokeh 3.9 / jupyter_bokeh 4.1 /
JupyterLab 4.6):

* jupyter_bokeh's lab extension does **not** bundle BokehJS.  Its
  ``BokehView`` constructor calls ``window.Bokeh.require("protocol/receiver")``
  straight away, so without a global ``Bokeh`` the view throws and the widget
  manager logs ``Could not create a view for model id <id>`` (the view shows
  nothing).
* The same lab extension registers a renderer for the MIME type
  ``application/vnd.bokehjs_load.v0+json`` whose payload is put into a
  ``<script>`` element; that is how ``bokeh.io.output_notebook`` loads BokehJS
  in JupyterLab.  With ``resources=CDN`` (the default) that script fetches
  from cdn.bokeh.org, which is unreachable offline, so we load it inline.
* ``output_notebook`` publishes the ~4 MB script twice (``application/
  javascript`` for the classic notebook and the JupyterLab MIME type) and
  includes MathJax (1.8 MB).  We publish only the JupyterLab MIME type (it is
  rendered exactly where ``BokehModel`` works: both need jupyter_bokeh's lab
  extension) plus a ``text/plain`` fallback, and leave MathJax out: about
  2.1 MB once per kernel.  The output is trusted because the cell ran in this
  session (the renderer is registered as unsafe, so an untrusted reopened
  notebook shows the text fallback).
* BokehJS's version must match the Python bokeh that serialises the models;
  inline resources come from the installed package, so it always does.
* Executed headless (nbclient, no browser) this is just one ``display_data``
  message; nothing fails.  Outside an IPython kernel it does nothing.

Caveat: the "loaded" flag lives in the kernel, BokehJS lives in the browser
page.  After *reloading the browser tab* with the same kernel running, call
``ensure_bokehjs(force=True)`` (or restart the kernel) before showing plots.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import ipywidgets
    from bokeh.models import LayoutDOM

__all__ = ["BOKEHJS_COMPONENTS", "LOAD_MIME_TYPE", "batched_bokeh_widget", "bokeh_widget", "bokehjs_loaded",
           "ensure_bokehjs"]

#: MIME type rendered by jupyter_bokeh's lab extension as an inline <script>.
LOAD_MIME_TYPE = "application/vnd.bokehjs_load.v0+json"

#: BokehJS bundles injected (MathJax left out: big, and the dashboard has no TeX).
BOKEHJS_COMPONENTS: tuple[str, ...] = ("bokeh", "bokeh-gl", "bokeh-widgets", "bokeh-tables")

_lock = threading.Lock()
_loaded = False


def kernel_shell() -> Any | None:
    """The IPython shell if we run inside a Jupyter kernel, else None."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is an ipywidgets dependency
        return None
    shell = get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    return shell


def _loader_js() -> str:
    """BokehJS (inline) wrapped in bokeh's own notebook autoload template."""
    from bokeh.embed.bundle import bundle_for_objs_and_resources
    from bokeh.io.notebook import _loading_js  # private, stable since bokeh 2.x
    from bokeh.resources import Resources

    resources = Resources(mode="inline", components=list(BOKEHJS_COMPONENTS))  # type: ignore[arg-type]
    bundle = bundle_for_objs_and_resources(None, resources)
    return _loading_js(bundle, None, register_mime=False)


def bokehjs_loaded() -> bool:
    """Whether :func:`ensure_bokehjs` has already sent BokehJS from this kernel."""
    return _loaded


def ensure_bokehjs(*, force: bool = False) -> None:
    """Send BokehJS inline to the notebook frontend, at most once per kernel.

    Idempotent: re-running a cell does not re-send the ~2 MB script.  Pass
    ``force=True`` after reloading the browser tab (the new page has no
    BokehJS, but the kernel cannot know).  No-op outside a Jupyter kernel.
    """
    global _loaded
    with _lock:
        if _loaded and not force:
            return
        if kernel_shell() is None:
            return
        from bokeh import __version__ as bokeh_version
        from IPython.display import publish_display_data

        try:
            js = _loader_js()
            data = {
                LOAD_MIME_TYPE: js,
                "text/plain": f"BokehJS {bokeh_version} (inline)",
            }
        except ImportError:  # pragma: no cover - bokeh moved a private helper
            from bokeh.io import output_notebook
            from bokeh.resources import INLINE

            output_notebook(resources=INLINE, hide_banner=True)
        else:
            publish_display_data(data)
        _loaded = True


def bokeh_widget(obj: LayoutDOM) -> ipywidgets.DOMWidget:
    """``jupyter_bokeh.BokehModel(obj)``, after making sure BokehJS is loaded.

    Build the figure and its sources once, then only ``stream``/``patch`` them
    from the kernel's event loop thread.
    """
    from jupyter_bokeh import BokehModel

    ensure_bokehjs()
    return BokehModel(obj)


def batched_bokeh_widget(obj: LayoutDOM) -> ipywidgets.DOMWidget:
    """Like :func:`bokeh_widget`, for a figure that is only ever updated from Python.

    The widget (a ``BokehModel`` subclass) adds, for jupyter_bokeh 4.1:

    * ``batch()``: every change made to the document inside it goes out as *one*
      PATCH-DOC at the end. jupyter_bokeh sends each event as its own PATCH-DOC, i.e.
      three comm messages (header, metadata, content) per ``stream`` or property change.
    * No boomerang: the browser view re-sends every event it applied from a patch back to
      the kernel as a "jsevent", and jupyter_bokeh would apply it again (a streamed row
      would be appended twice to the Python source). Events from the browser are ignored
      here, except BokehJS's ``document_ready``, which says a view has rendered.
    * ``live``: patches are only sent while True. A view that renders after patches went
      out has missed them (it starts from ``render_bundle``); worse, one created between
      the three messages of a patch would read them out of step for good. So the owner
      sets ``live = False`` when the widget is displayed, and when ``document_ready``
      arrives calls ``resync()`` (send the whole current document) if anything changed
      since the bundle was made, then sets ``live`` again. While not live the Python
      document still changes; nothing is sent.
    """
    ensure_bokehjs()
    from bokeh.document import Document
    from bokeh.models import CustomJS

    if obj.document is None:
        Document().add_root(obj)
    assert obj.document is not None
    obj.document.js_on_event("document_ready", CustomJS(code=QUIET_VIEW_JS))
    obj.document.js_on_event("document_ready", CustomJS(code=VISIBILITY_JS))
    obj.document.js_on_event("document_ready", CustomJS(code=SAME_CSS_JS))
    return _batched_class()(obj)


#: Runs in the page once a view's document has rendered (after it told the kernel so). It
#: stops the view from echoing the document's changes to the kernel: jupyter_bokeh's view
#: sends every event it applies from a patch back as a "jsevent" (whole streamed rows
#: included), one comm message each, which the kernel must read on its shell, queued ahead
#: of the user's next cell; the kernel ignores them all anyway (see BatchedBokehModel). Only
#: MessageSent events (document_ready of a later render) still go through.
QUIET_VIEW_JS = """
const doc = cb_obj;
if (doc == null || doc._callbacks == null || doc.__trio_quiet) return;
doc.__trio_quiet = true;
for (const [callback, batches] of [...doc._callbacks]) {
  doc._callbacks.delete(callback);
  doc._callbacks.set((event) => { if (event != null && event.kind === "MessageSent") callback(event); }, batches);
}
"""


#: Runs in the page once a view's document has rendered: two patches of BokehJS 3.9 (made once
#: per page) that keep a paint from restyling the page. At every paint BokehJS rewrites each
#: renderer's position <style>, and a glyph renderer's position is its data's box on screen,
#: which moves whenever rows stream in or the time axis follows; then it reads each text's
#: colour through getComputedStyle, which recalculates the styles of the whole notebook after
#: each rewrite (~140 recalcs a second with the dashboard training: most of the page's time).
#: 1. A style sheet is written only when its text changed (it holds nothing but its text).
#: 2. In this document, a glyph renderer's element keeps no position: it is an empty box (glyphs
#:    paint on the plot's canvas; hover finds them through the data, not the element).
SAME_CSS_JS = """
const doc = cb_obj;
if (doc != null) doc.__trio_dashboard = true;
let dom, glyphs;
try { dom = Bokeh.require("core/dom"); glyphs = Bokeh.require("models/renderers/glyph_renderer"); }
catch (e) { return; }
const sheet = dom.InlineStyleSheet && dom.InlineStyleSheet.prototype;
if (sheet != null && !sheet.__trio_same_css && typeof sheet._update === "function") {
  const update = sheet._update;
  sheet._update = function (css) { if (this.el.textContent !== css) update.call(this, css); };
  sheet.__trio_same_css = true;
}
const view = glyphs.GlyphRendererView && glyphs.GlyphRendererView.prototype;
if (view != null && !view.__trio_no_position && typeof view.update_position === "function") {
  const update_position = view.update_position;
  view.update_position = function () {
    const d = this.model && this.model.document;
    if (!(d != null && d.__trio_dashboard)) update_position.call(this);
  };
  view.__trio_no_position = true;
}
"""

#: Runs in the page once a view's document has rendered: it tells the kernel whether the view
#: can be seen (the tab is visible and the dashboard it is in is on screen: Page Visibility API and an
#: IntersectionObserver), so that the kernel sends nothing to a view nobody sees (BokehJS lays
#: out and redraws on every patch, hidden or not). A MessageSent event is the one kind the
#: view still passes to the kernel (QUIET_VIEW_JS). While hidden it says so again every
#: HIDDEN_REPORT_S seconds: the kernel only trusts a recent "hidden" (one it cannot hear,
#: e.g. while a cell blocks it, might be visible again by now).
VISIBILITY_JS = """
const doc = cb_obj;
if (doc == null || doc.__trio_visibility) return;
doc.__trio_visibility = true;
let MessageSentEvent;
try { MessageSentEvent = Bokeh.require("document/events").MessageSentEvent; } catch (e) { return; }
const view_id = Math.random().toString(36).slice(2);
let el = null, observer = null, on_screen = true, shown = null, timer = null, tries = 0, stopped = false;
// a closed dashboard's view leaves the page, a dead kernel's is marked disconnected: their
// comm is gone and a report would fail; stop everything instead. A document the widget view
// replaced (it re-renders from the whole document) says it is gone: its view no longer counts
let widget = null;
const alive = () => el != null && el.isConnected && el.closest(".jupyter-widgets-disconnected") == null;
const send = (fields) => {
  try {
    const data = {name: "trio_visibility", view: view_id, ...fields};
    doc._trigger_on_change(new MessageSentEvent(doc, "bokeh_event", data));
    return true;
  } catch (e) { return false; }
};
const stop = () => {
  stopped = true;
  if (timer != null) { clearInterval(timer); timer = null; }
  if (observer != null) observer.disconnect();
  document.removeEventListener("visibilitychange", report);
};
function report() {
  if (stopped) return;
  if (!alive()) {
    if (widget != null && widget.isConnected && widget.closest(".jupyter-widgets-disconnected") == null)
      send({visible: false, gone: true});
    stop();
    return;
  }
  const visible = on_screen && document.visibilityState !== "hidden";
  if (visible !== shown || !visible) {
    shown = visible;
    if (!send({visible: visible})) { stop(); return; }
  }
  if (timer != null) { clearInterval(timer); timer = null; }
  if (!visible) timer = setInterval(report, REPORT_MS);
}
const observe = () => {
  for (const view of (Bokeh.index && Bokeh.index.roots) || [])
    if (view.model.document === doc) { el = view.el; break; }
  if (el == null) { if (++tries < 50) setTimeout(observe, 100); return; }
  widget = el.parentElement && el.parentElement.parentElement;  // the widget view's element
  observer = new IntersectionObserver((entries) => {
    on_screen = entries[entries.length - 1].isIntersecting;
    report();
  });
  // the whole dashboard counts: its text (status, a room's table) is read with the figures scrolled away
  observer.observe(el.closest(".trio-dashboard") || el);
  document.addEventListener("visibilitychange", report);
};
observe();
"""
#: how often a hidden view says again that it is hidden; the kernel forgets a "hidden" that is
#: HIDDEN_TRUST_S old (throttled timers of a tab hidden for minutes may then let it push again)
HIDDEN_REPORT_S = 4.0
HIDDEN_TRUST_S = 10.0
VISIBILITY_JS = VISIBILITY_JS.replace("REPORT_MS", str(int(HIDDEN_REPORT_S * 1000)))
#: views whose visibility is remembered (a reloaded page leaves its old views behind, silent)
_VIEWS_KEPT = 16


def _plain(value: Any) -> Any:
    """A value the page serialised, with BokehJS's maps ({"type": "map", "entries": ...}) as dicts."""
    if isinstance(value, dict):
        if value.get("type") == "map" and isinstance(value.get("entries"), list):
            return {_plain(k): _plain(v) for k, v in value["entries"]}
        return {k: _plain(v) for k, v in value.items()}
    return value


_BATCHED_CLASS = None


def _batched_class() -> type:
    global _BATCHED_CLASS
    if _BATCHED_CLASS is not None:
        return _BATCHED_CLASS
    import contextlib
    import json

    from bokeh.protocol import Protocol
    from jupyter_bokeh import BokehModel

    class BatchedBokehModel(BokehModel):
        _held: list | None = None
        live: bool = True
        #: the document changed since render_bundle was made (a view built from it is behind)
        stale: bool = False
        #: PATCH-DOC messages sent (each is 3 comm messages plus 2 per binary buffer)
        patches_sent: int = 0
        #: events made while not live (not sent)
        events_dropped: int = 0
        #: jsevents from views that were ignored (mostly echoes of our own patches)
        echoes_ignored: int = 0
        #: document_ready messages received (a view rendered); written on the comm thread
        views_ready: int = 0

        #: patches held back while no view can be seen (pause / resume)
        paused: bool = False
        #: (model id, attribute) -> (model, attribute) changed while paused; None: send it all
        _dirty: dict | None = None

        def _document_patched(self, event: Any) -> None:
            if event.setter is self:
                return
            self.stale = True
            if not self.live:
                self.events_dropped += 1
                return
            if self.paused:
                model, attr = getattr(event, "model", None), getattr(event, "attr", None)
                if self._dirty is not None and model is not None and isinstance(attr, str):
                    self._dirty[(model.id, attr)] = (model, attr)
                else:  # an event that is not one property's change: the catch-up sends everything
                    self._dirty = None
                return
            if self._held is not None:
                self._held.append(event)
                return
            self._send_patch([event])

        @contextlib.contextmanager
        def batch(self):
            if self._held is not None:  # nested: the outer batch sends
                yield
                return
            self._held = []
            try:
                yield
            finally:
                events, self._held = self._held, None
                if events:
                    self._send_patch(events)

        _refs: dict | None = None
        _refs_key: int = -1

        def _patch_message(self, events: list) -> Any:
            """bokeh's PATCH-DOC for `events`, without rebuilding the reference map of every model
            in the document each time (milliseconds per tick with ~800 models; the dashboard
            adds none after it is built, so the map is reused until the synced set changes)."""
            try:
                from bokeh.core.serialization import Serializer
                from bokeh.document.json import PatchJson
                from bokeh.protocol.messages.patch_doc import patch_doc

                doc = events[0].document
                synced = doc.models.synced_references
                if self._refs is None or self._refs_key != len(synced):
                    self._refs = {id(obj): obj.ref for obj in synced}
                    self._refs_key = len(synced)
                serializer = Serializer()
                serializer._references = dict(self._refs)
                content = PatchJson(events=serializer.encode(events))
                doc.models.flush_synced(lambda model: not serializer.has_ref(model))
                msg = patch_doc(patch_doc.create_header(), {}, content)
                msg.add_buffers(*serializer.buffers)
                return msg
            except (AttributeError, ImportError):  # pragma: no cover - bokeh changed its internals
                return Protocol().create("PATCH-DOC", events)

        def _send_patch(self, events: list) -> None:
            msg = self._patch_message(events)
            self.send({"msg": "patch", "payload": msg.header_json})
            self.send({"msg": "patch", "payload": msg.metadata_json})
            self.send({"msg": "patch", "payload": msg.content_json})
            for buffer in msg.buffers:
                self.send({"msg": "patch", "payload": json.dumps(buffer.ref)})
                self.send({"msg": "patch"}, [buffer.to_bytes()])
            self.patches_sent += 1

        def pause(self) -> None:
            """Send nothing until resume(); remember what changed (bounded: one entry per property)."""
            if not self.paused:
                self.paused = True
                self._dirty = {}

        def resume(self) -> None:
            """Send what changed while paused, as one PATCH-DOC of the current values (not the
            changes one by one: a view that could not be seen needs only the last picture)."""
            if not self.paused:
                return
            self.paused = False
            dirty, self._dirty = self._dirty, None
            if not self.live:
                return
            if dirty is None:
                self.resync()
                return
            if not dirty:
                return
            from bokeh.document.events import ModelChangedEvent

            doc = self._model.document
            events = [ModelChangedEvent(doc, model, attr, getattr(model, attr)) for model, attr in dirty.values()
                      if model.document is doc]
            if events:
                self._send_patch(events)

        #: view id -> (visible, time.monotonic() of its last report), newest last; written on the
        #: comm thread, read on the dashboard's (whole-dict replacement: no torn reads)
        visibility: dict = {}  # noqa: RUF012 - replaced, never mutated in place
        #: visibility reports received
        visibility_reports: int = 0

        def views_hidden(self, now: float | None = None) -> bool:
            """Every view the page told us of is hidden, and said so recently."""
            seen = self.visibility
            if not seen:
                return False
            now = time.monotonic() if now is None else now
            return all(not visible and now - at <= HIDDEN_TRUST_S for visible, at in seen.values())

        def _sync_model(self, _model: Any, content: dict[str, Any], _buffers: list[Any]) -> None:
            # Runs on whichever thread handles comm messages: count only, change nothing.
            if content.get("event") != "jsevent":
                return
            data = _plain(content.get("msg_data"))
            name = data.get("name") if isinstance(data, dict) and content.get("kind") == "MessageSent" else None
            if name == "document_ready":
                self.views_ready += 1
            elif name == "trio_visibility":
                seen = {k: v for k, v in self.visibility.items() if k != data.get("view")}
                if not data.get("gone"):  # (gone: the view re-rendered from a new document)
                    seen[str(data.get("view"))] = (bool(data.get("visible")), time.monotonic())
                self.visibility = dict(list(seen.items())[-_VIEWS_KEPT:])
                self.visibility_reports += 1
            else:
                self.echoes_ignored += 1

        def resync(self) -> None:
            """Send the whole current document: every view re-renders from it."""
            self.update_from_model(self._model)
            self.stale = False

        def close(self) -> None:
            # jupyter_bokeh's close is not idempotent (ipywidgets calls close() again from __del__)
            if getattr(self, "_trio_closed", False):
                return
            self._trio_closed = True
            try:
                super().close()
            except KeyError:  # pragma: no cover - already unregistered from the document
                pass

    _BATCHED_CLASS = BatchedBokehModel
    return BatchedBokehModel
