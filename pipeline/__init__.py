"""pagedserve's process pipeline and public Python API.

`from pipeline import LLM, AsyncLLM, SamplingParams, EngineClient, AsyncEngineClient`
"""
from pipeline.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineClient", "AsyncEngineClient",
           "RequestOutput", "CompletionOutput", "RequestError"]

_LAZY = {"LLM": "pipeline.llm", "AsyncLLM": "pipeline.llm", "EngineClient": "pipeline.client",
         "AsyncEngineClient": "pipeline.client", "RequestOutput": "pipeline.outputs",
         "CompletionOutput": "pipeline.outputs", "RequestError": "pipeline.outputs"}


def __getattr__(name: str):
    # Lazy, so that role processes importing pipeline.* don't pay for the client stack.
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
