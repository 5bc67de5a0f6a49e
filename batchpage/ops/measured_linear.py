"""linear_backend="auto": each distinct linear shape of the model bound to whichever
implementation runs it fastest on this machine, measured at bind, never guessed from CPU flags.

Which implementation wins depends on the CPU and on the shape: batchpage's AVX512-BF16 kernel
beats oneDNN on some CPUs, and oneDNN's AMX path beats it several times over on others
(BENCHMARKS.md). So at bind every candidate that can run here makes the layer, each is timed on
random rows at the row counts that matter (a decode step's few rows up to a full batch), and
the one with the best geometric mean of its time relative to the fastest at each row count is
kept. A SiLU-gated MLP's merged gate/up linear is measured both ways: fused (the activation in
the kernel) against the best plain candidate followed by the activation. A quantized
checkpoint's linears are measured the same way among the int implementations that take them
(for int8 activations: batchpage's VNNI kernel and oneDNN's int8 matmul, which runs on AMX-INT8
where the CPU has it, both exact in their int32 sums, and the A16 kernel fed the int8 rows,
which rounds W to bf16), and, where the engine allows it (`dense_ints`: the model's dense copy
fits its memory budget), against the layer dequantized once into the engine's dtype: where
many rows run a dense bf16 matmul (on AMX above all) beats unpacking 4-bit values on the fly.

The choices are cached on disk (`ChoiceCache`) under a key of everything that decides them: the
CPU's model and flags, the torch build, the dtype, the row counts and each candidate's identity
(a compiled kernel's library name, which changes with its source); a second bind on the same
setup measures nothing but a spot check of each cached choice against its runner-up.

A busy machine can rank the candidates in another order than a quiet one, and a start's choice
lasts for every later start, so a measurement says how far it can be trusted
(ops/linear_timing.py: the share of their ready time our threads ran, and the spread of the
repeats against the winner's lead). One that is not trusted is repeated (up to TRIES times, or
twice where the machine stays busy); still untrusted, it is not cached: the shape keeps the
cached choice where it had one, else uses the measured one, cached apart as provisional: the
next start measures it again, unless its spot check finds the machine still busy (measuring
then would be no better; it reuses the provisional choice). The spot check times the cached
choice against its runner-up at one row count, a few repeats; a choice that loses by more than
a margin is measured again in full. `report()` says, per shape, how its choice was made and
the load and run share it was measured under (run.json's linear_measurement).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from batchpage.cpu_info import cpu_flags, cpu_model
from batchpage.ops.choice_cache import CachedChoice, ChoiceCache
from batchpage.ops.dequantized_linear import DequantizedLinear
from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import IntCandidate, LinearMethod, torch_int_linear
from batchpage.ops.linear_timing import (
    Clock,
    fastest,
    judge,
    medians,
    spot_check,
    time_linears,
)

if TYPE_CHECKING:  # the scheme module imports batchpage.model, which imports the ops
    from batchpage.quant.int_weight import IntWeight
    from batchpage.quant.scheme import QuantScheme

log = logging.getLogger(__name__)

# Measurements of one shape at most, while they are not to be trusted.
TRIES = 3
# Timed calls of a cached choice and its runner-up at the spot check.
SPOT_REPEATS = 3
UNFUSED = "plain+activation"  # a gated MLP's plain linear, then SiLU(gate) * up
DENSE = "dense"  # a quantized layer dequantized once, on the fastest dense candidate


class ActivatedLinear(LinearOp):
    """A merged [gate | up] linear followed by SiLU(gate) * up: a plain candidate's side of the
    fused-or-not measurement for a gated MLP."""

    def __init__(self, inner: LinearOp) -> None:
        super().__init__()
        self.inner = inner

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        gate, up = self.inner.apply(x, None).chunk(2, dim=-1)
        return F.silu(gate) * up

    @property
    def weight_format(self) -> str:
        return self.inner.weight_format


class DenseWithRows(LinearOp):
    """A quantized layer whose rows are read every step (a tied head, whose table the lookups
    read) held both ways: dense for its matmul, its int module for the rows."""

    def __init__(self, dense: LinearOp, rows: LinearOp) -> None:
        super().__init__()
        self.dense, self.rows = dense, rows
        self.in_features, self.out_features = rows.in_features, rows.out_features

    def apply(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        return self.dense.apply(x, out)

    def weight_rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows.weight_rows(ids)

    @property
    def weight_format(self) -> str:
        return f"{self.dense.weight_format}+{self.rows.weight_format}"  # e.g. "bf16+q8_0"


def setup_key(
    candidates: Sequence[LinearMethod | IntCandidate], dtype: torch.dtype, rows: Sequence[int]
) -> dict:
    """What decides the choices, for ChoiceCache: a changed CPU, torch build, kernel or thread
    count (a tensor-parallel rank's share of the cores) measures again."""
    return {
        "cpu": cpu_model(),
        "threads": str(torch.get_num_threads()),
        "flags": hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16],
        "torch": f"{torch.__version__} {torch.version.git_version}",
        "dtype": str(dtype),
        "rows": ",".join(map(str, rows)),
        "candidates": ",".join(f"{c.name}={c.version}" for c in candidates),
    }


class MeasuredLinears:
    """The LinearMethod over dense `candidates` (each able to run here; the first with a fused
    SiLU(gate) * up offers it) and quantized `int_candidates`: `method()` makes each layer with
    the candidate measured (or cached) fastest for its shape among those that take it. One
    dense candidate is a forced backend: its own layers, unmeasured. `choices` records shape ->
    candidate, for llm.stats."""

    def __init__(
        self,
        candidates: Sequence[LinearMethod],
        dtype: torch.dtype,
        rows: Sequence[int],
        cache: ChoiceCache,
        int_candidates: Sequence[IntCandidate] = (),
        dense_ints: bool = False,
        clock: Clock | None = None,
    ) -> None:
        # A candidate without `make` (torch's, keeping the loaded Linear) can only be forced.
        assert len(candidates) == 1 or all(c.make is not None for c in candidates), candidates
        self.candidates = {c.name: c for c in candidates}
        self.int_candidates = {c.name: c for c in int_candidates}
        # A quantized layer may also be held dense (DENSE), on the fastest dense candidate.
        self.dense_ints = dense_ints
        self.dtype, self.rows, self.cache = dtype, tuple(rows), cache
        self.clock = clock or Clock()  # what the timings read (tests: a scripted one)
        self.choices: dict[str, str] = {}
        # Every shape's choice made in this process, measured only for another's or not: the
        # next layer of that shape takes it as is (no second measurement or spot check).
        self._decided: dict[str, str] = {}
        self._notes: dict[str, dict[str, Any]] = {}  # shape -> how its choice was made
        self.measured = 0  # shapes timed in full in this process (the rest came from the cache)
        self.seconds = 0.0  # spent timing them and spot-checking the cached ones

    def report(self) -> dict[str, Any]:
        """How each reported shape's choice was made (run.json's linear_measurement): per shape
        `how` (measured: here, trusted and cached; provisional: here, not to be trusted after
        its tries, cached apart for the next start to measure again; reused: an earlier start's
        provisional choice, the machine still busy at its spot check; cached: from the cache,
        its spot check passed; unchecked: from the cache, the machine too busy to spot-check
        it; re-measured: the cached one lost its spot check and was replaced; kept: it lost,
        but the new measurement was not to be trusted), the load per CPU, run share, spread
        and margin it was measured with (linear_timing.Trust) and, for a cached one, its spot
        check's figures. {} where nothing was chosen among several."""
        shapes = {s: self._notes[s] for s in self.choices if s in self._notes}
        if not shapes:
            return {}
        return {"seconds": round(self.seconds, 3), "measured": self.measured, "shapes": shapes}

    @property
    def forced(self) -> bool:
        return len(self.candidates) == 1

    def method(self) -> LinearMethod:
        make_int = self.make_int if self.int_candidates else torch_int_linear
        if self.forced:
            (only,) = self.candidates.values()
            return replace(only, make_int=make_int)
        fused = any(c.silu_mul is not None for c in self.candidates.values())
        return LinearMethod("auto", self.make, self.silu_mul if fused else None, make_int)

    def make(self, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearOp:
        out_f, in_f = weight.shape
        shape = f"{out_f}x{in_f}{'+bias' if bias is not None else ''}"

        def build(name: str) -> LinearOp:
            return self.candidates[name].make(weight, bias)  # type: ignore[misc]

        return self._choose(shape, in_f, list(self.candidates), build)

    def silu_mul(self, weight: torch.Tensor) -> LinearOp | None:
        """The fused module where it wins for this gate/up shape; None where the plain linear
        and the layer's own activation do (bind then makes the plain one)."""
        out_f, in_f = weight.shape
        fused = [n for n, c in self.candidates.items() if c.silu_mul is not None]

        def build(name: str) -> LinearOp:
            if name == UNFUSED:
                return ActivatedLinear(self.make(weight, None))
            return self.candidates[name].silu_mul(weight)  # type: ignore[misc]

        chosen = self._choose(f"silu_mul:{out_f}x{in_f}", in_f, [*fused, UNFUSED], build)
        if isinstance(chosen, ActivatedLinear):
            return None
        self.choices.pop(f"{out_f}x{in_f}", None)  # its plain side was only measured
        return chosen

    def make_int(
        self,
        weight: IntWeight,
        bias: torch.Tensor | None,
        scheme: QuantScheme,
        reads_rows: bool = False,
    ) -> LinearOp:
        """A quantized layer's module: the fastest of the int candidates that take it (that
        give its rows back cheaply, where the lookups read them), and of its dense form on the
        fastest dense candidate where `dense_ints` (weights without int8 activations; where
        the rows are read, the dense form keeps the first int module beside it for them)."""
        names = [
            n
            for n, c in self.int_candidates.items()
            if c.takes(weight, scheme) and (c.gives_rows or not reads_rows)
        ]
        assert names, f"no int candidate takes {scheme.name}"  # the A16 kernel takes all
        if self.dense_ints and not scheme.int8_activations:
            names.append(DENSE)
        n, k, group = weight.out_features, weight.in_features, weight.group_size
        shape = f"{scheme.name}:{n}x{k}/{min(group, k)}{'+bias' if bias is not None else ''}"
        shape += "+rows" if reads_rows else ""
        dense_shape = f"{n}x{k}{'+bias' if bias is not None else ''}"
        dense_known = dense_shape in self.choices

        def build(name: str) -> LinearOp:
            if name != DENSE:
                return self.int_candidates[name].make(weight, bias, scheme)
            made = DequantizedLinear(weight, bias, self.dtype, False, self.make)
            if not reads_rows or made.gives_rows():
                return made
            return DenseWithRows(made, self.int_candidates[names[0]].make(weight, bias, scheme))

        chosen = self._choose(shape, k, names, build)
        if self.choices[shape] != DENSE and not dense_known:
            self.choices.pop(dense_shape, None)  # its dense form was only measured
        return chosen

    def _choose(
        self, shape: str, in_f: int, names: list[str], build: Callable[[str], LinearOp]
    ) -> LinearOp:
        """The module of the choice for `shape`: the only one, the one made earlier in this
        process, the cached one that passes its spot check, else each of `names` built and
        timed, the fastest kept (and cached where the measurement can be trusted)."""
        chosen = names[0] if len(names) == 1 else self._decided.get(shape)
        entry = None if chosen in names else self.cache.entry(shape)
        if chosen in names:
            module = build(chosen)
        elif entry is not None and entry.choice in names:
            held, made = self._spot_check(shape, in_f, names, build, entry)
            if held:
                chosen, module = entry.choice, made[entry.choice]
            else:  # (a provisional choice is no previous one to keep)
                previous = None if entry.provisional else entry.choice
                chosen, module = self._measure(shape, in_f, names, build, previous, made)
        else:
            chosen, module = self._measure(shape, in_f, names, build, None, {})
        self._decided[shape] = chosen
        self.choices[shape] = chosen
        return module

    def _spot_check(
        self,
        shape: str,
        in_f: int,
        names: list[str],
        build: Callable[[str], LinearOp],
        entry: CachedChoice,
    ) -> tuple[bool, dict[str, LinearOp]]:
        """Time the cached choice against its runner-up (a cache without one: every other
        candidate) at one row count: whether it holds (a win: it does not lose, or the machine
        is too busy to tell; a provisional choice: the machine is still too busy to measure
        better), and the modules built (reused by `_measure` where it does not)."""
        rivals = [n for n in names if n != entry.choice]
        if entry.runner_up in rivals:
            rivals = [entry.runner_up]
        start = self.clock.wall()
        made = {n: build(n) for n in [entry.choice, *rivals]}
        # The second fewest rows (a few decode steps' worth, where batch jobs spend their
        # steps): cheap to time, and above a single row's fixed costs.
        rows = self.rows[min(1, len(self.rows) - 1)]
        sample = time_linears(made, rows, in_f, self.dtype, self.clock, SPOT_REPEATS)
        spot = spot_check(sample, entry.choice)
        self.seconds += self.clock.wall() - start
        if entry.provisional:
            self._notes[shape] = {"how": "reused", **entry.measured, **spot.record()}
            if not spot.busy:
                log.info("linear shape %s: its provisional choice measured again", shape)
            return spot.busy, made
        how = "unchecked" if spot.busy else "cached"
        self._notes[shape] = {"how": how, **entry.measured, **spot.record()}
        if not spot.lost:
            if entry.runner_up is None and not spot.busy:  # an older cache's: keep its rival
                self.cache.put(shape, entry.choice, spot.rival, entry.measured)
            return True, made
        log.info(
            "linear shape %s: the cached %s is %.2fx slower than %s at %d rows; measuring again",
            shape, entry.choice, spot.loss, spot.rival, rows,
        )  # fmt: skip
        return False, made

    def _measure(
        self,
        shape: str,
        in_f: int,
        names: list[str],
        build: Callable[[str], LinearOp],
        previous: str | None,
        made: dict[str, LinearOp],
    ) -> tuple[str, LinearOp]:
        """Each of `names` built (unless in `made`) and timed at every row count, up to TRIES
        times while the measurement is not to be trusted (twice where the machine stays busy);
        the fastest cached where it is, else `previous` (the cached choice) kept, else the
        fastest used and cached apart as provisional."""
        # Seconds per shape where it must measure (a new CPU, torch or kernel): say which.
        log.info("measuring the linears of shape %s: %s", shape, ", ".join(names))
        start = self.clock.wall()
        made = {n: made[n] if n in made else build(n) for n in names}
        tries, busy = 0, False
        while True:
            tries += 1
            samples = [time_linears(made, r, in_f, self.dtype, self.clock) for r in self.rows]
            chosen = fastest(medians(samples))
            trust = judge(samples, chosen)
            # Noise passes; other work that lasted two measurements will likely last a third.
            if trust.reliable or tries == TRIES or (busy and trust.busy):
                break
            busy = trust.busy
        self.seconds += self.clock.wall() - start
        self.measured += 1
        if trust.reliable:
            self.cache.put(shape, chosen, trust.runner_up, trust.record())
            how = "measured" if previous is None else "re-measured"
        else:
            log.info(
                "linear shape %s: not to be trusted after %d measurements (%s): %s",
                shape, tries, trust.why(),
                f"the cached {previous} kept" if previous else f"{chosen}, provisional",
            )  # fmt: skip
            if previous is None:
                self.cache.put(shape, chosen, trust.runner_up, trust.record(), provisional=True)
            how = "provisional" if previous is None else "kept"
            chosen = previous or chosen
        spot = {k: v for k, v in self._notes.get(shape, {}).items() if k.startswith("spot_")}
        self._notes[shape] = {"how": how, **trust.record(), "tries": tries, **spot}
        return chosen, made[chosen]
