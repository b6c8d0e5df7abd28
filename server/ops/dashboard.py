"""The operator's dashboard (``starfed server dashboard``): the federation on one web page.

``starfed server status`` answers once, in a terminal; an operator who watches a federation for
months keeps a page open instead. This one shows the same reading of the folders as ``status``
(``status.read``: one reader for both) and draws what a person would rather look at than read:
the steps over time, the accuracy by arrival step and per site, the accuracy matrix, the bytes
on the wire. It updates itself every few seconds while a run goes on, and between runs, or
with the server stopped, it shows the folders as they are (docs/deployment.md#dashboard).

- **Read-only.** Only GET routes; the server folder and the federation folder are read, never
  written (no lock, no cache file). Logs are served by name from the listing of the server
  folder's ``logs/`` only: a name that is not a regular file there (``..``, a link, a
  sub-folder) is 404, and they go out as ``text/plain`` with ``nosniff``, so a log line is never
  a page.
- **Holds up.** ``status.read`` guards every file: a damaged, truncated or missing one is named
  under "cannot read" and the rest is shown. The codebook, the registry and the history are
  each written atomically by the server, so a reading mid-step sees the old file or the new.
- **Cheap.** The files are read at most once a second, whoever asks; the running SuperLink
  (``flwr``, a second or two) and its log's refused keys at most every ``SLOW_EVERY_S``
  (``dashboard_state.py``). Plots are drawn once per change of what they show: an image's
  address carries a digest of its data, so the browser fetches it again only when it changed.
- **No authentication**, so it listens on 127.0.0.1 and is reached through an SSH tunnel.

The module is the web app (routes, image cache, the socket); what it shows is read in
``dashboard_state.py``, drawn in ``dashboard_plots.py`` and laid out by the Jinja2 templates of
``dashboard_page.py`` (``templates/dashboard_*.html``, autoescaped).

Why Starlette and uvicorn: Flower 1.42 depends on both (they serve its REST Fleet API), so nothing
new is installed; Starlette is the small ASGI toolkit (routing, responses, file streaming, a
test client) that FastAPI is built on, and a few read-only GET routes need none of FastAPI's
request models or OpenAPI; uvicorn is the ASGI server Flower itself runs. The page's templates
are Jinja2's, a dependency of torch as well. Nothing here imports torch.
"""

from __future__ import annotations

import io
import socket
import threading
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from starlette.routing import Route

from starfed.server.ops.dashboard_page import fragment, page
from starfed.server.ops.dashboard_plots import PLOTS, digest
from starfed.server.ops.dashboard_state import Reader, State, log_files
from starfed.server.ops.layout import ServerFolder

NO_STORE = {"Cache-Control": "no-store"}


class Dashboard:
    """The dashboard of one server folder and one federation folder (reads only)."""

    def __init__(self, folder: ServerFolder, federation_dir: Path, refresh_s: float) -> None:
        self.folder = folder
        self.refresh_s = refresh_s
        self._reader = Reader(folder, federation_dir)
        self._lock = threading.Lock()
        self._images: dict[str, tuple[str, bytes]] = {}

    def state(self) -> State:
        """The folders read now, or at most ``dashboard_state.READ_EVERY_S`` ago."""
        return self._reader.state()

    def image(self, name: str) -> tuple[str, bytes] | None:
        """(digest, PNG) of a plot of the current state; drawn again only when its data changed."""
        data = PLOTS[name].data(self.state())
        if not data:
            return None
        version = digest(data)
        with self._lock:
            cached = self._images.get(name)
        if cached is None or cached[0] != version:
            out = io.BytesIO()
            PLOTS[name].draw(data, out)
            cached = (version, out.getvalue())
            with self._lock:
                self._images[name] = cached
        return cached

    def log(self, name: str) -> Path | None:
        """A log of the listing by its exact name, else None: nothing else is ever served."""
        if any(f.name == name for f in log_files(self.folder)):
            return self.folder.logs / name
        return None

    def app(self) -> Starlette:
        def index(request: Request) -> Response:
            return HTMLResponse(page(self.state(), self.refresh_s), headers=NO_STORE)

        def live(request: Request) -> Response:
            return HTMLResponse(fragment(self.state()), headers=NO_STORE)

        def api_state(request: Request) -> Response:
            return JSONResponse(self.state().to_json(), headers=NO_STORE)

        def plot(request: Request) -> Response:
            name = request.path_params["name"]
            image = self.image(name) if name in PLOTS else None
            if image is None:
                return PlainTextResponse("no such plot, or nothing to draw yet", 404)
            version, png = image
            fresh = request.query_params.get("v") == version
            headers = {"Cache-Control": "max-age=86400"} if fresh else NO_STORE
            return Response(png, media_type="image/png", headers=headers)

        def log(request: Request) -> Response:
            path = self.log(request.path_params["name"])
            if path is None:
                return PlainTextResponse("no such log", 404)
            headers = {**NO_STORE, "X-Content-Type-Options": "nosniff"}
            return FileResponse(path, media_type="text/plain; charset=utf-8", headers=headers)

        return Starlette(
            routes=[
                Route("/", index),
                Route("/live", live),
                Route("/api/state", api_state),
                Route("/plots/{name}.png", plot),
                Route("/logs/{name}", log),
            ]
        )


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (OSError when the address is taken), before anything is served."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def serve(dashboard: Dashboard, listening: socket.socket) -> None:
    """Answer until SIGINT/SIGTERM (uvicorn's own handling: requests in flight finish)."""
    config = uvicorn.Config(dashboard.app(), log_level="warning", access_log=False, lifespan="off")
    uvicorn.Server(config).run(sockets=[listening])
