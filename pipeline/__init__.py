"""pagedserve's process pipeline and public Python API.

`from pagedserve.pipeline import LLM, AsyncLLM, SamplingParams, EngineClient, AsyncEngineClient`
"""
from pagedserve.pipeline.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineClient", "AsyncEngineClient",
           "RequestOutput", "CompletionOutput", "RequestError"]

_LAZY = {"LLM": "pagedserve.pipeline.llm", "AsyncLLM": "pagedserve.pipeline.llm", "EngineClient": "pagedserve.pipeline.client",
         "AsyncEngineClient": "pagedserve.pipeline.client", "RequestOutput": "pagedserve.pipeline.outputs",
         "CompletionOutput": "pagedserve.pipeline.outputs", "RequestError": "pagedserve.pipeline.outputs"}


def __getattr__(name: str):
    # Lazy, so that role processes importing pipeline.* don't pay for the client stack.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
