"""An ASGI app (the server's, the router's) under uvicorn in a background thread."""

from __future__ import annotations

import socket
import threading
import time


class BackgroundServer:
    """An ASGI app under uvicorn in a background thread (a notebook, a benchmark, a test):

        with BackgroundServer(build_app(engine)) as url:   # http://127.0.0.1:PORT
            ...

    port 0 picks a free one."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                     log_level=log_level))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.uvicorn.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)
