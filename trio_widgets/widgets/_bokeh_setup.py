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

        def _document_patched(self, event: Any) -> None:
            if event.setter is self:
                return
            self.stale = True
            if not self.live:
                self.events_dropped += 1
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

        def _sync_model(self, _model: Any, content: dict[str, Any], _buffers: list[Any]) -> None:
            # Runs on whichever thread handles comm messages: count only, change nothing.
            if content.get("event") != "jsevent":
                return
            data = content.get("msg_data")
            if content.get("kind") == "MessageSent" and isinstance(data, dict) and data.get("name") == "document_ready":
                self.views_ready += 1
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
