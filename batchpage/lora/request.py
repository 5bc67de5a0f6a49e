"""LoRARequest: which adapter a prompt runs with (vLLM's shape)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors).

    `lora_int_id` (>= 1) identifies the adapter within an engine: requests with the same id
    share its loaded weights and its prefix-cache entries, so one id must always name the same
    folder. `lora_name` is how outputs and stats name it."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise TypeError(f"lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 is the base model); got {self.lora_int_id}"
            )
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
