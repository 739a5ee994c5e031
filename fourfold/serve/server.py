"""Running the app under uvicorn: in the foreground for `fourfold serve`, or in a thread for tests and benchmarks.

SIGTERM and Ctrl-C stop accepting connections and give in-flight requests `graceful_s` seconds to finish;
requests still running then are cancelled, which aborts their engine requests (their KV blocks are freed)
before the engine itself shuts down.
"""

from __future__ import annotations

import threading
import time

import uvicorn


def uvicorn_config(app, host: str, port: int, graceful_s: float, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful_s,
                          access_log=False, lifespan="on")


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that a signal it shut down on gracefully ends the process with exit code 0
    (uvicorn re-raises it, which reads as "killed by SIGTERM"); a second signal forces the exit."""

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


def serve_forever(app, host: str, port: int, graceful_s: float = 30.0) -> None:
    """Serve until SIGTERM/SIGINT, then give in-flight requests `graceful_s` seconds."""
    GracefulServer(uvicorn_config(app, host, port, graceful_s)).run()


class BackgroundServer:
    """The app on 127.0.0.1 and a free port, in a daemon thread: `with BackgroundServer(app) as s: s.url`."""

    def __init__(self, app, graceful_s: float = 5.0):
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", 0, graceful_s, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
