"""The LoRA adapters served by name: what the ingress resolves a request's `model` to, and what
the Python API checks a LoRARequest against before submitting it.

Adding an adapter checks its files against the base model (pipeline/lora_files.py) and gives it
an id that no adapter before it had, in this process or an earlier one (a random 48-bit id):
the workers' host cache and the prefix cache key adapters by id, so a restarted ingress must
not hand out an id a worker still holds for another adapter. Removing one only stops new
requests from naming it; the requests that run keep their LoRARequest and finish.
"""
from __future__ import annotations

import logging
import os
import secrets

from pagedserve.pipeline.lora_files import AdapterFiles, BaseShapes, LoRAFileError, check_adapter
from pagedserve.pipeline.lora_request import LoRARequest

log = logging.getLogger("pagedserve.lora")

MAX_NAME_CHARS = 256


class LoRARegistry:
    def __init__(self, base: BaseShapes, base_model_name: str, max_rank: int,
                 reserved_names: tuple[str, ...] = ()) -> None:
        self.base, self.base_model_name, self.max_rank = base, base_model_name, max_rank
        self.reserved = set(reserved_names) | {base_model_name}
        self.adapters: dict[str, LoRARequest] = {}
        self._checked: dict[tuple[int, str], AdapterFiles] = {}

    def add(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at `path` as model `name`; LoRAFileError naming the cause."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS \
                or not name.isprintable():
            raise LoRAFileError(f"lora_name must be 1 to {MAX_NAME_CHARS} printable characters")
        if name in self.reserved:
            raise LoRAFileError(f"lora_name {name!r} is the base model's name")
        if name in self.adapters:
            raise LoRAFileError(f"a LoRA adapter named {name!r} is already loaded; unload it "
                                f"first")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise LoRAFileError("lora_path must be a non-empty path")
        path = os.path.realpath(path) if os.path.isabs(path) else path
        files = check_adapter(path, self.base, self.max_rank)
        lora = LoRARequest(lora_name=name, lora_int_id=secrets.randbits(48) | 1, lora_path=path,
                           base_model_name=self.base_model_name)
        self.adapters[name] = lora
        self._checked[lora.lora_int_id, path] = files
        log.info("LoRA adapter %r added (id %d, rank %d, %s file %s)", name, lora.lora_int_id,
                 files.rank, files.format, os.path.basename(path.rstrip("/")))
        return lora

    def remove(self, name: str) -> LoRARequest:
        lora = self.adapters.pop(name, None) if isinstance(name, str) else None
        if lora is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        self._checked.pop((lora.lora_int_id, lora.lora_path), None)
        log.info("LoRA adapter %r removed (id %d); its running requests finish",
                 name, lora.lora_int_id)
        return lora

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    def check(self, lora: LoRARequest) -> None:
        """A LoRARequest made by a caller (the Python API): its files fit the model (checked
        once per id and path)."""
        key = (lora.lora_int_id, lora.lora_path)
        if key not in self._checked:
            self._checked[key] = check_adapter(lora.lora_path, self.base, self.max_rank)
