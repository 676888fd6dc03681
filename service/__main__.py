"""`python -m service --host 127.0.0.1 --port 8080 --state-dir ./k3-service`."""

from __future__ import annotations

import logging
import sys

import uvicorn

from service.app import create_app
from service.settings import parse_args


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    where = "the one given" if settings.token else f"in {settings.state_dir / 'token'}"
    try:
        app = create_app(settings)
    except (ValueError, OSError) as e:  # a state dir in use, or one that cannot be made or written
        sys.exit(f"python -m service: error: {e}")
    logging.getLogger("service").info("state in %s; %d GPU(s) to schedule; bearer token: %s",
                                      settings.state_dir, settings.gpus, where)
    # NOTE: keep-alive past a dashboard's polling interval, so a busy client does not race the server's close.
    # A stopping server waits for open responses: log streams end when it is told to stop (they would hold it up
    # until their runs end), and whatever is still open 10 s later is cancelled.
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                                           limit_concurrency=256, timeout_keep_alive=30, timeout_graceful_shutdown=10))
    app.state.service.closing = lambda: server.should_exit
    server.run()


if __name__ == "__main__":
    main(sys.argv[1:])
