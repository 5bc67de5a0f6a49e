"""AdapterSlots against a brute-force model of the same rules, through random admissions and
departures."""

from __future__ import annotations

import random

import pytest

from batchpage.engine.adapter_slots import AdapterSlots
from batchpage.lora.request import LoRARequest


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


class Model:
    """The rules, written plainly: resident adapters in slots, users per adapter, LRU among
    the slots of adapters that no running sequence uses."""

    def __init__(self, n: int) -> None:
        self.slots: list[int | None] = [None] * n
        self.users: dict[int, int] = {}
        self.used_at: list[int] = [0] * n
        self.time = 0

    def can_take(self, i: int) -> bool:
        return i in self.slots or any(self.users.get(a, 0) == 0 for a in self.slots)

    def take(self, i: int) -> int | None:
        self.time += 1
        load = None
        if i not in self.slots:
            idle = [s for s, a in enumerate(self.slots) if self.users.get(a, 0) == 0]
            load = min(idle, key=lambda s: self.used_at[s])
            self.slots[load] = i
        slot = self.slots.index(i)
        self.users[i] = self.users.get(i, 0) + 1
        self.used_at[slot] = self.time
        return load


@pytest.mark.parametrize("seed", range(6))
def test_slots_follow_the_brute_force_model(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 4)
    slots, model = AdapterSlots(n), Model(n)
    running: list[LoRARequest | None] = []
    for _ in range(300):
        if running and rng.random() < 0.45:
            gone = running.pop(rng.randrange(len(running)))
            slots.give_back(gone)
            if gone is not None:
                model.users[gone.lora_int_id] -= 1
        else:
            want = None if rng.random() < 0.2 else lora(rng.randint(1, 6))
            i = 0 if want is None else want.lora_int_id
            assert slots.can_take(want) == (want is None or model.can_take(i))
            if not slots.can_take(want):
                continue
            load = slots.take(want)
            assert load == (None if want is None else model.take(i))
            running.append(want)
        slots.check_integrity(running)
        assert [r.lora_int_id if r else None for r in slots.resident] == model.slots
        for r in running:
            if r is not None:  # a running adapter's slot is the one it was loaded into
                assert slots.resident[slots.slot_of(r)] == r


def test_a_slot_in_use_is_never_reloaded():
    slots = AdapterSlots(1)
    assert slots.take(lora(1)) == 0
    assert not slots.can_take(lora(2))
    assert slots.take(lora(1)) is None  # resident: no load
    slots.give_back(lora(1))
    slots.give_back(lora(1))
    assert slots.can_take(lora(2)) and slots.take(lora(2)) == 0
    assert slots.slot_of(None) == -1
