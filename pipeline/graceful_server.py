"""uvicorn's server for our HTTP roles (the ingress, the router): a requested stop is a normal
exit, not an end by the signal."""
from __future__ import annotations

import logging
import signal

import uvicorn


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT logs `stopping` and shuts down gracefully, and
    whose SIGINT during that shutdown forces the exit."""

    def __init__(self, config: uvicorn.Config, log: logging.Logger, stopping: str) -> None:
        super().__init__(config)
        self._log, self._stopping = log, stopping

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn's own handler re-raises the signal after its graceful shutdown, which would
        # end the process with -SIGTERM; a requested stop that succeeded is a normal exit.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            if not self.should_exit:
                self._log.info("stop requested (%s): %s", signal.Signals(sig).name,
                               self._stopping)
            self.should_exit = True
