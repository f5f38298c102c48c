"""LoRA adapters over HTTP, as vLLM serves them: a request's `model` names the base model or an
adapter; POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter
{"lora_name"} change the adapters at run time (behind the API key; refused unless the server
runs with --enable-lora); /v1/models lists each adapter with its base model as `parent`.

Unloading stops new requests from naming the adapter; the ones that run keep it and finish.
The adapters served are kept in a 0600 file of the group's ipc folder, so that a restarted
ingress serves the ones loaded at run time too.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from pagedserve.pipeline.ingress.errors import APIError, invalid
from pagedserve.pipeline.ingress.json_body import decode_json_object
from pagedserve.pipeline.ingress.openapi import ErrorResponse, request_body
from pagedserve.pipeline.ingress.validation import check_model_name, read_body
from pagedserve.pipeline.lora_config import LoRAArgs, parse_lora_module
from pagedserve.pipeline.lora_files import BaseShapes, LoRAFileError
from pagedserve.pipeline.lora_registry import LoRARegistry
from pagedserve.pipeline.lora_request import LoRARequest
from pagedserve.private_files import read_private, write_private

log = logging.getLogger("pagedserve.ingress")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(description="the model name requests use to select it")
    lora_path: str = Field(description="absolute path on the server: a PEFT folder "
                                       "(adapter_config.json, adapter_model.safetensors) or a "
                                       "llama.cpp LoRA .gguf")


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str


class LoRAAdapterStatus(BaseModel):
    lora_name: str
    status: str = Field(description="loaded or unloaded")
    message: str


LORA_MODELS = (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)
_ERRORS = {
    400: {"model": ErrorResponse, "description": "The body is not valid, or the adapter does "
                                                 "not fit the model (the message says why)."},
    404: {"model": ErrorResponse, "description": "LoRA is disabled (--enable-lora), or no "
                                                 "adapter of that name is loaded."},
    408: {"model": ErrorResponse, "description": "The body did not arrive in time."},
    413: {"model": ErrorResponse, "description": "The body is larger than --max-request-bytes."},
}


def build_registry(args: LoRAArgs, model_dir: str, base_model_name: str,
                   state_file: str | None = None) -> LoRARegistry | None:
    """The served adapters at start: --lora-modules (one that does not fit stops the start
    with the cause), then those loaded at run time by an earlier incarnation of this ingress
    (`state_file`, in the group's private ipc folder; one that no longer fits is dropped with
    a warning). None with LoRA off."""
    if not args.enable_lora:
        return None
    registry = LoRARegistry(BaseShapes.from_model_dir(model_dir), base_model_name,
                            args.max_lora_rank)
    for entry in args.lora_modules:
        name, path = parse_lora_module(entry)
        try:
            registry.add(name, path)
        except LoRAFileError as exc:
            raise ValueError(f"--lora-modules {name}: {exc}") from None
    for name, path in _saved(state_file).items():
        if name not in registry.adapters:
            try:
                registry.add(name, path)
            except LoRAFileError as exc:
                log.warning("LoRA adapter %r loaded before a restart is not served again: %s",
                            name, exc)
    return registry


def _saved(state_file: str | None) -> dict[str, str]:
    if state_file is None or not os.path.exists(state_file):
        return {}
    try:
        saved = json.loads(read_private(state_file, "the LoRA adapter list"))
    except (OSError, ValueError) as exc:
        log.warning("LoRA adapters loaded before a restart are lost: %s", exc)
        return {}
    return {str(k): str(v) for k, v in saved.items()} if isinstance(saved, dict) else {}


def _save(ctx) -> None:
    """Every adapter served now, for a restarted ingress (0600 in the private ipc folder)."""
    if ctx.lora_state_file is None:
        return
    temporary = f"{ctx.lora_state_file}.{os.getpid()}.tmp"
    try:
        if os.path.lexists(temporary):
            os.unlink(temporary)
        write_private(temporary, json.dumps(
            {name: lora.lora_path for name, lora in ctx.loras.adapters.items()}))
        os.replace(temporary, ctx.lora_state_file)
    except OSError as exc:   # served all the same; only a restart would forget it
        log.warning("the LoRA adapter list was not saved for a restart: %s", exc)


def resolve_model(ctx, requested: str | None) -> LoRARequest | None:
    """The adapter a request's `model` names (None: the base model); 404 for any other name."""
    loras = ctx.loras
    lora = loras.get(requested) if loras is not None else None
    if lora is None:
        check_model_name(requested, ctx.served_model_names + sorted(loras.adapters)
                         if loras is not None else ctx.served_model_names)
    return lora


def model_cards(ctx, created: int, capabilities: dict) -> list[dict[str, Any]]:
    """/v1/models entries of the adapters (their paths are not shown)."""
    if ctx.loras is None:
        return []
    return [{"id": name, "object": "model", "created": created, "owned_by": "pagedserve",
             "root": name, "parent": lora.base_model_name, "max_model_len": ctx.max_model_len,
             "capabilities": capabilities} for name, lora in sorted(ctx.loras.adapters.items())]


def add_lora_routes(v1: APIRouter, ctx, errors: dict) -> None:
    errors = {**_ERRORS, **errors}
    @v1.post("/load_lora_adapter", response_model=LoRAAdapterStatus, responses=errors,
             openapi_extra=request_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> dict:
        """Serve a LoRA adapter (a PEFT folder or a GGUF file on the server) by name."""
        body = await _body(ctx, request)
        name, path = body.get("lora_name"), body.get("lora_path")
        try:
            lora = _registry(ctx).add(name, path)
        except LoRAFileError as exc:
            raise invalid(f"LoRA adapter {name!r} not loaded: {exc}", "lora_path") from None
        _save(ctx)
        return {"lora_name": lora.lora_name, "status": "loaded",
                "message": f"Success: LoRA adapter '{lora.lora_name}' added successfully."}

    @v1.post("/unload_lora_adapter", response_model=LoRAAdapterStatus, responses=errors,
             openapi_extra=request_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> dict:
        """Stop serving an adapter; its running requests finish."""
        body = await _body(ctx, request)
        name = body.get("lora_name")
        try:
            _registry(ctx).remove(name)
        except KeyError as exc:
            raise APIError(404, exc.args[0], param="lora_name",
                           code="lora_adapter_not_found") from None
        _save(ctx)
        return {"lora_name": name, "status": "unloaded",
                "message": f"Success: LoRA adapter '{name}' removed successfully."}


async def _body(ctx, request: Request) -> dict:
    body = decode_json_object(await read_body(request, ctx.max_request_bytes))
    if not isinstance(body.get("lora_name"), str):
        raise invalid("lora_name must be a string", "lora_name")
    return body


def _registry(ctx) -> LoRARegistry:
    if ctx.loras is None:
        raise APIError(404, "LoRA is disabled: start the server with --enable-lora to load "
                            "adapters", code="lora_disabled")
    return ctx.loras
