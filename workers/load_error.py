"""Where ModelLoadError was; it is a contract now (pipeline/load_error.py). Kept for the
launcher's import until it names the new place."""
from pagedserve.pipeline.load_error import ModelLoadError

__all__ = ["ModelLoadError"]
