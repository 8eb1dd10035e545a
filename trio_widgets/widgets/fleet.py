"""A fleet's dashboard: `trio.Dashboard(url)` on a fleet's URL (trio_widgets/http/fleet.py).

>>> dash = trio.Dashboard("http://fleet:8000", api_key="tml-observer")   # a FleetDashboard

One view of the fleet: a header line of its totals (pools alive, sessions, clients, updates,
tokens: `GET /api/v1/trio/fleet`), a selector with one button per pool ("pool-0 (cpu, 2
sessions)"; a dead pool is marked so), and below it the ordinary `Dashboard` of the selected
pool (`url + "/trio/pools/<k>"`, a served pool's dashboard). Switching pools closes the
shown pool's dashboard (its reader thread too) and opens the other's.

One thread of its own ("trio-remote-fleet-N") asks the fleet for its totals every
`refresh_s` seconds and does the switches the selector asks for (a widget callback only
records the wish and wakes it: opening a pool's stream takes a round trip or more, which a
callback must not wait for). `close()` stops it and closes the pool's dashboard.

This module does not import the Dashboard: `dashboard.py` builds a FleetDashboard with a
function that makes a pool's dashboard (no import cycle).
"""

from __future__ import annotations

import html
import itertools
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import ipywidgets as W

from ..errors import APIConnectionError, AuthenticationError, PermissionDeniedError

__all__ = ["FleetDashboard", "fleet_info"]

log = logging.getLogger(__name__)

FLEET_PATH = "/api/v1/trio/fleet"
#: the URL of one pool of a fleet: a served pool, never a fleet (no need to ask)
_POOL_OF_FLEET = re.compile(r"/trio/pools/\d{1,4}/?$")
_IDS = itertools.count(1)

_CSS = """<style>
.trio-fleet { font-family: Inter, 'Segoe UI', Helvetica, Arial, sans-serif; max-width: 100%; min-width: 0; }
.trio-fleet .trio-fleet-title { font-size: 15px; font-weight: 650; color: #111827; }
.trio-fleet .trio-fleet-title .trio-sub { font-size: 12px; font-weight: 400; color: #6b7280; margin-left: 8px; }
.trio-fleet .trio-fleet-totals { font-size: 12.5px; color: #374151; line-height: 1.55; }
.trio-fleet .trio-fleet-totals b { color: #111827; font-variant-numeric: tabular-nums; }
.trio-fleet .trio-notice { color: #92400e; }
.trio-fleet .trio-notice.bad { color: #991b1b; }
</style>"""


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _detail(answer: httpx.Response) -> str:
    try:
        body = answer.json()
    except ValueError:
        return answer.text
    return str(body.get("detail", answer.text)) if isinstance(body, dict) else answer.text


def fleet_info(url: Any, api_key: str | None, timeout_s: float = 30.0) -> dict | None:
    """What `GET {url}/api/v1/trio/fleet` says of a fleet, or None when `url` is not a fleet's
    (a served pool answers 404; anything but an http(s) URL is left to the pool's checks).

    A key the fleet refuses raises as the single-pool path does: AuthenticationError (none or
    unknown) or PermissionDeniedError (a training key: watching needs an observer key)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or _POOL_OF_FLEET.search(url):
        return None
    base = url.rstrip("/")
    headers = {"X-API-Key": api_key} if api_key else {}
    try:
        answer = httpx.get(base + FLEET_PATH, headers=headers, timeout=timeout_s)
    except httpx.TransportError as exc:
        raise APIConnectionError(f"cannot reach the trio server at {base}: {exc}") from None
    if answer.status_code in (401, 403):
        error = AuthenticationError if answer.status_code == 401 else PermissionDeniedError
        raise error(_detail(answer), answer)
    if answer.status_code == 503 and "fleet" in _detail(answer):  # a fleet, none of whose pools answers
        raise APIConnectionError(f"cannot watch the fleet at {base}: {_detail(answer)}")
    if answer.status_code != 200:
        return None  # (404: a served pool; its own path says what else is wrong)
    try:
        info = answer.json()
    except ValueError:
        return None
    return info if isinstance(info, dict) and isinstance(info.get("pools"), list) else None


def pool_label(pool: dict) -> str:
    """A selector button's label: "pool-0 (cpu, 2 sessions)", or "pool-1 (dead)"."""
    name = str(pool.get("name", f"pool-{pool.get('index')}"))
    if not pool.get("alive"):
        return f"{name} (dead)"
    sessions = int(pool.get("sessions") or 0)
    return f"{name} ({pool.get('device', '?')}, {sessions} session{'' if sessions == 1 else 's'})"


class FleetDashboard(W.VBox):
    """A fleet's totals, a pool selector, and the selected pool's Dashboard (see the module doc).

    `pool_dashboard(url)` builds the Dashboard of the pool served at `url` (dashboard.py passes
    one that keeps the settings `trio.Dashboard(...)` was given). `select(k)` shows pool k, as
    its button does; `refresh()` reads the fleet's totals now."""

    def __init__(self, url: str, *, api_key: str | None, pool_dashboard: Callable[[str], Any],
                 info: dict | None = None, refresh_s: float = 2.0, title: str = "trio · fleet"):
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be a number of seconds above 0, got {refresh_s!r}")
        self._closed = True  # until built: what close() reads if __init__ fails
        self.url = url.rstrip("/")
        self._headers = {"X-API-Key": api_key} if api_key else {}
        self._make = pool_dashboard
        self.refresh_s = float(refresh_s)
        self._title = title
        if info is None:
            info = fleet_info(self.url, api_key)
            if info is None:
                raise APIConnectionError(f"{self.url} is not a fleet (GET {FLEET_PATH} did not list pools)")
        self._info: dict = info
        self._error: str | None = None
        self._notice: tuple[str, bool] | None = None
        self._lock = threading.RLock()  # the shown pool: switched by the thread, closed by close()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._switched = threading.Condition()
        self._wanted: int | None = None
        self._syncing = False
        self.dashboard: Any = None  # the shown pool's Dashboard
        self.index: int | None = None  # the shown pool
        self._epoch: str | None = None  # its process (a restarted pool is reopened)
        self._http: httpx.Client | None = None

        self._header = W.HTML("")
        self._selector = W.ToggleButtons(options=[(pool_label(p), int(p["index"])) for p in self.pools],
                                         value=None, style={"button_width": "auto"})
        self._selector.observe(self._on_select, names="value")
        self._body = W.VBox([], layout=W.Layout(width="100%", max_width="100%"))
        super().__init__(children=[self._header, self._selector, self._body],
                         layout=W.Layout(width="100%", max_width="100%", overflow="hidden"))
        self.add_class("trio-fleet")
        self._display_id = f"trio-fleet-{uuid.uuid4().hex}"
        self._shown = False
        self._closed = False
        first = next((int(p["index"]) for p in self.pools if p.get("alive")), None)
        try:
            if first is not None:
                self._show(first, first=True)  # the first pool's dashboard, here: its errors are the caller's
            else:
                self._say("no pool of this fleet is answering now", bad=True)
        except BaseException:
            self.close()
            raise
        self._render()
        self._http = httpx.Client(headers=self._headers, timeout=httpx.Timeout(10.0, connect=5.0))
        self._thread = threading.Thread(target=self._run, name=f"trio-remote-fleet-{next(_IDS)}", daemon=True)
        self._thread.start()

    # -- what it reads ------------------------------------------------------------------------
    @property
    def pools(self) -> list[dict]:
        """The pools as the fleet last listed them (GET /api/v1/trio/fleet's "pools")."""
        return list(self._info.get("pools", []))

    @property
    def totals(self) -> dict:
        """The fleet's totals as last read: sessions, clients, total_updates, total_tokens, pools, alive."""
        return dict(self._info.get("totals", {}))

    @property
    def header_text(self) -> str:
        return self._header.value

    @property
    def selector(self) -> W.ToggleButtons:
        return self._selector

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def widgets(self) -> list[W.Widget]:
        return [self._header, self._selector, self._body]

    def refresh(self) -> dict:
        """Read the fleet's totals now (the thread does every `refresh_s`); returns them."""
        self._refresh()
        return self.totals

    # -- switching ------------------------------------------------------------------------------
    def select(self, index: int, timeout: float = 60.0) -> Any:
        """Show pool `index` (as its button does) and return its Dashboard (None if the pool is
        not answering: the view says so)."""
        if not isinstance(index, int) or not any(int(p["index"]) == index for p in self.pools):
            raise ValueError(f"this fleet has pools {[int(p['index']) for p in self.pools]}; got {index!r}")
        if self._closed:
            raise RuntimeError("this fleet dashboard is closed")
        self._want(index)
        deadline = time.monotonic() + timeout
        with self._switched:
            while self.index != index or self._wanted is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise TimeoutError(f"pool-{index}'s dashboard did not open within {timeout:g} s")
                self._switched.wait(min(left, 0.5))
        return self.dashboard

    def _on_select(self, change: dict) -> None:  # a widget callback: any thread, waits for nothing
        if self._syncing or change.get("new") is None or change["new"] == self.index:
            return
        self._want(int(change["new"]))

    def _want(self, index: int) -> None:
        with self._switched:
            self._wanted = index
        self._wake.set()

    def _show(self, index: int, *, first: bool = False) -> None:
        """Close the shown pool's dashboard, open pool `index`'s (on the fleet's thread; `first`:
        in __init__, where a failure is the caller's error)."""
        with self._lock:
            if self._closed:
                return
            self._close_dashboard()
            pool = next((p for p in self.pools if int(p["index"]) == index), {"index": index})
            name = str(pool.get("name", f"pool-{index}"))
            epoch = pool.get("epoch")
            self.index, self._epoch = index, str(epoch) if epoch is not None else None
            try:
                dash = self._make(f"{self.url}/trio/pools/{index}")
            except Exception as exc:
                if first:
                    raise
                self._say(f"{name} is not answering now (dead or restarting): {exc}", bad=True)
                self._body.children = [W.HTML(f"<i>{html.escape(name)} is not answering now.</i>")]
                self._sync_selector()
                return
            self.dashboard = dash
            self._say(None)
            dash.expect_view()  # a view of it renders now (in the page showing this one)
            self._body.children = [dash]
            self._sync_selector()

    def _close_dashboard(self) -> None:
        dash, self.dashboard = self.dashboard, None
        if dash is not None:
            self._body.children = []
            dash.close()  # its thread and its RemotePool's reader

    # -- the fleet's thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            next_refresh = time.monotonic() + self.refresh_s
            while not self._stop.is_set():
                self._wake.wait(max(0.0, next_refresh - time.monotonic()))
                self._wake.clear()
                if self._stop.is_set():
                    break
                with self._switched:
                    wanted = self._wanted
                if wanted is not None and wanted != self.index:
                    try:
                        self._show(wanted)
                    except Exception as exc:  # noqa: BLE001 - said in the view
                        log.exception("opening pool-%s's dashboard failed", wanted)
                        self._say(f"pool-{wanted}: {exc}", bad=True)
                    self._render()
                with self._switched:
                    if self._wanted == wanted:  # (a newer wish is done next)
                        self._wanted = None
                    self._switched.notify_all()
                if time.monotonic() >= next_refresh:
                    self._refresh()
                    next_refresh = time.monotonic() + self.refresh_s
        finally:
            with self._lock:
                self._close_dashboard()
            with self._switched:
                self._switched.notify_all()

    def _refresh(self) -> None:
        client = self._http
        if client is None or self._closed:
            return
        try:
            answer = client.get(self.url + FLEET_PATH)
            if answer.status_code == 200:
                self._info = answer.json()
                self._error = None
            else:
                self._error = f"the fleet answered {answer.status_code}: {_detail(answer)}"
        except (httpx.HTTPError, ValueError) as exc:
            self._error = f"cannot reach the fleet: {type(exc).__name__}: {exc}"
        self._follow_restart()
        self._sync_selector()
        self._render()

    def _follow_restart(self) -> None:
        """The shown pool restarted (a new process, Ray's new replica): show the new one."""
        if not self._lock.acquire(blocking=False):
            return  # a switch is under way: it reads the pools it needs
        try:
            if self.index is None or self._closed:
                return
            pool = next((p for p in self.pools if int(p["index"]) == self.index), None)
            if pool is None or not pool.get("alive"):
                return
            if pool.get("epoch") != self._epoch or self.dashboard is None:
                with self._switched:
                    if self._wanted is not None:
                        return  # another pool was asked for meanwhile
                    self._wanted = self.index
                self.index = None  # (the thread opens it again next)
                self._wake.set()
        finally:
            self._lock.release()

    # -- drawing -----------------------------------------------------------------------------------
    def _say(self, text: str | None, bad: bool = False) -> None:
        self._notice = None if text is None else (text, bad)

    def _sync_selector(self) -> None:
        options = [(pool_label(p), int(p["index"])) for p in self.pools]
        value: int | None = self.index if self.index is not None else self._selector.value
        if list(self._selector.options) == options and self._selector.value == value:
            return
        self._syncing = True
        try:
            if list(self._selector.options) != options:
                self._selector.options = options
            self._selector.value = value if any(v == value for _, v in options) else None
        finally:
            self._syncing = False

    def _render(self) -> None:
        totals = self.totals
        host = self.url.split("://", 1)[-1]
        title = (f"{_CSS}<div class='trio-fleet-title'>{html.escape(self._title)}"
                 f"<span class='trio-sub'>{html.escape(host)}</span></div>")
        line = (f"pools <b>{totals.get('alive', 0)}</b>/<b>{totals.get('pools', 0)}</b> alive · "
                f"sessions <b>{totals.get('sessions', 0)}</b> · clients <b>{totals.get('clients', 0)}</b> · "
                f"updates <b>{totals.get('total_updates', 0)}</b> · "
                f"tokens <b>{_si(float(totals.get('total_tokens', 0) or 0))}</b>")
        for text, bad in ([(self._error, True)] if self._error else []) + ([self._notice] if self._notice else []):
            line += f"<br><span class='trio-notice{' bad' if bad else ''}'>{html.escape(text)}</span>"
        value = f"{title}<div class='trio-fleet-totals'>{line}</div>"
        if self._header.value != value:
            self._header.value = value

    # -- display and closing ------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        dash = self.dashboard
        if dash is not None:
            dash.expect_view()
        return super()._repr_mimebundle_(**kwargs)

    def _ipython_display_(self) -> None:
        # under a display id, so that close() can leave the fleet's last totals in its place
        from IPython.display import display

        if self._closed:
            display(self._snapshot_bundle(), raw=True)
            return
        self._shown = True
        display(self._repr_mimebundle_(), raw=True, display_id=self._display_id)

    def _snapshot_bundle(self) -> dict[str, str]:
        when = time.strftime("%H:%M:%S")
        body = (f"<div class='trio-fleet trio-snapshot'>{self._header.value}"
                f"<div class='trio-fleet-totals'><i>Snapshot of the fleet's dashboard when it closed ({when}); "
                f"it no longer updates.</i></div></div>")
        return {"text/html": body, "text/plain": f"<trio fleet dashboard snapshot, closed {when}>"}

    def close(self) -> None:
        """Stop the thread, close the shown pool's dashboard (its reader too) and the widgets."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(60.0)
        with self._lock:
            self._close_dashboard()
        if self._http is not None:
            self._http.close()
        if self._shown:
            try:
                from IPython.display import update_display

                update_display(self._snapshot_bundle(), raw=True, display_id=self._display_id)
            except Exception:
                log.exception("could not leave a snapshot of the fleet's dashboard")
        from ._comms import closing

        owned = [self._header, self._selector, self._body]
        closing([self, *owned])
        super().close()
        for w in owned:
            w.close()
