"""Small helpers every role process uses: lifecycle logging, parent-death signal, config hand-off."""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

from pagedserve.pipeline.config import EngineConfig

_PR_SET_PDEATHSIG = 1


def setup_logging(role: str) -> logging.Logger:
    logging.basicConfig(level=os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s [{role} pid=%(process)d] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    return logging.getLogger(f"pagedserve.{role}")


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to signal us when the launcher dies, so no role outlives its group."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's cleanup still applies
        pass
    if os.getppid() == 1:  # parent already gone before prctl took effect
        os.kill(os.getpid(), sig)


def role_arg_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--config-json", required=True, help="EngineConfig as JSON (from the launcher)")
    p.add_argument("--rank", type=int, default=0)
    return p


def load_config(ns: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_json(ns.config_json)
