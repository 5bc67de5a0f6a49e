"""AdapterRegistry: the adapters an engine has read, by lora_int_id.

Each adapter is read (and checked against the base model) once, when its first request is
added; its weights stay in host memory for the engine's life, from where the model runner
copies them into a slot whenever the scheduler makes it resident (engine/adapter_slots.py).
"""

from __future__ import annotations

from batchpage.lora.adapter import AdapterError, LoRAAdapter, TargetShapes, read_adapter
from batchpage.lora.request import LoRARequest


class AdapterRegistry:
    def __init__(self, targets: TargetShapes, max_rank: int) -> None:
        self.targets = targets
        self.max_rank = max_rank
        self._read: dict[int, LoRAAdapter] = {}

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, read on first use; AdapterError when it cannot run on this model, or
        when its lora_int_id already names another folder."""
        known = self._read.get(request.lora_int_id)
        if known is None:
            known = read_adapter(request, self.targets, self.max_rank)
            self._read[request.lora_int_id] = known
        elif known.path != request.lora_path:
            raise AdapterError(
                f"LoRA adapter {request.lora_name!r}: lora_int_id {request.lora_int_id} already "
                f"names {known.path}, not {request.lora_path}: give each adapter its own id"
            )
        return known

    def check(self, request: LoRARequest) -> str | None:
        """None when the adapter can run, else why not (a request's error)."""
        try:
            self.get(request)
        except AdapterError as exc:
            return str(exc)
        return None
