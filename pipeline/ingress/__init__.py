"""The OpenAI-compatible HTTP ingress: `python -m pagedserve.pipeline.ingress --config-file ...`.

FastAPI on uvicorn (uvloop); a client of the engine through AsyncEngineClient. See app.py for
the routes, completions.py / chat.py for the two generation endpoints.
"""
from pagedserve.pipeline.ingress.app import build_app
from pagedserve.pipeline.ingress.context import IngressContext

__all__ = ["build_app", "IngressContext"]
