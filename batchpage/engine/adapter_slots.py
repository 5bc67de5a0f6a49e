"""AdapterSlots: which LoRA adapter each of the engine's max_loras slots holds, for the scheduler.

Bookkeeping only. A sequence takes its adapter's slot when the scheduler admits it and gives it
back when it leaves the running set (finished, preempted, a beam replaced), so the running
sequences never need more than max_loras adapters and a step never does either. An adapter
that is not resident goes into a slot no running sequence uses, the least recently used one;
the scheduler asks for that load in its output and the model runner applies it before the
step's forward. A slot in use is never reloaded, so a running row's slot is stable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from batchpage.lora.request import LoRARequest


class AdapterSlots:
    def __init__(self, max_loras: int) -> None:
        self.resident: list[LoRARequest | None] = [None] * max_loras
        self.users = [0] * max_loras  # running sequences per slot
        self._last_used = [0] * max_loras
        self._clock = 0
        self._slot: dict[int, int] = {}  # lora_int_id -> slot

    def slot_of(self, lora: LoRARequest | None) -> int:
        """The slot of a resident adapter; -1 for the base model."""
        return -1 if lora is None else self._slot[lora.lora_int_id]

    def can_take(self, lora: LoRARequest | None) -> bool:
        """Whether a sequence of this adapter can run now: it is resident, or a slot is idle."""
        if lora is None or lora.lora_int_id in self._slot:
            return True
        assert self.resident, "a LoRA request reached an engine without enable_lora"
        return 0 in self.users

    def take(self, lora: LoRARequest | None) -> int | None:
        """One more running sequence of this adapter (can_take must hold). Returns the slot
        it must be loaded into, None when it is resident already (or the base model)."""
        if lora is None:
            return None
        self._clock += 1
        slot = self._slot.get(lora.lora_int_id)
        load = slot is None
        if slot is None:
            idle = [s for s, n in enumerate(self.users) if n == 0]
            slot = min(idle, key=lambda s: self._last_used[s])
            old = self.resident[slot]
            if old is not None:
                del self._slot[old.lora_int_id]
            self.resident[slot] = lora
            self._slot[lora.lora_int_id] = slot
        self.users[slot] += 1
        self._last_used[slot] = self._clock
        return slot if load else None

    def give_back(self, lora: LoRARequest | None) -> None:
        """A running sequence of this adapter left the running set; the adapter stays
        resident (a later request may use it) until its slot is needed."""
        if lora is None:
            return
        slot = self._slot[lora.lora_int_id]
        assert self.users[slot] > 0
        self.users[slot] -= 1

    def check_integrity(self, running: Iterable[LoRARequest | None]) -> None:
        """Each slot's users are exactly the running sequences of its adapter."""
        need = Counter(r.lora_int_id for r in running if r is not None)
        for slot, lora in enumerate(self.resident):
            expected = 0 if lora is None else need.pop(lora.lora_int_id, 0)
            assert self.users[slot] == expected, f"slot {slot}: {self.users[slot]} users"
            if lora is not None:
                assert self._slot[lora.lora_int_id] == slot
        assert not need, f"running adapters {sorted(need)} hold no slot"
        assert len(self._slot) == sum(r is not None for r in self.resident)
