"""LoRA adapters, many in one batch: reading PEFT folders, the slots they run in, the layers."""

from batchpage.lora.request import LoRARequest

__all__ = ["LoRARequest"]
