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
setup measures nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from batchpage.cpu_info import cpu_flags, cpu_model
from batchpage.fileio import atomic_write_text
from batchpage.ops.dequantized_linear import DequantizedLinear
from batchpage.ops.linear import LinearOp
from batchpage.ops.linear_method import IntCandidate, LinearMethod, torch_int_linear
from batchpage.paths import cache_dir

if TYPE_CHECKING:  # the scheme module imports batchpage.model, which imports the ops
    from batchpage.quant.int_weight import IntWeight
    from batchpage.quant.scheme import QuantScheme

log = logging.getLogger(__name__)

# Timed calls per candidate and row count, after one warm-up call; the median is kept.
REPEATS = 3
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


def time_linears(
    modules: dict[str, LinearOp], rows: int, in_features: int, dtype: torch.dtype
) -> dict[str, float]:
    """Seconds one call of each module takes on the same `rows` random rows: the median of
    REPEATS, the candidates taking turns, so that a burst of other load on a shared machine
    falls on all of them rather than on one."""
    x = torch.randn(rows, in_features, dtype=dtype)
    for module in modules.values():
        module.apply(x, None)  # first call: allocations, oneDNN's primitive creation
    times: dict[str, list[float]] = {name: [] for name in modules}
    for _ in range(REPEATS):
        for name, module in modules.items():
            start = time.perf_counter()
            module.apply(x, None)
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def fastest(timings: dict[str, list[float]]) -> str:
    """The candidate whose times, each relative to the fastest candidate's at that row count,
    have the smallest geometric mean (every row count weighs the same, whatever its size)."""
    names = list(timings)
    counts = len(next(iter(timings.values())))
    best = [min(timings[n][i] for n in names) for i in range(counts)]

    def score(name: str) -> float:
        return sum(math.log(t / b) for t, b in zip(timings[name], best, strict=True))

    return min(names, key=score)


class ChoiceCache:
    """Measured choices of one setup (`key`: what decides them), one JSON file each under
    `folder` (default: cache_dir()/linear_choices), shape key -> the chosen candidate."""

    def __init__(self, key: dict[str, str], folder: Path | None = None) -> None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.key = key
        self.path = (folder or cache_dir() / "linear_choices") / f"{digest}.json"

    def get(self, shape: str) -> str | None:
        return self._read().get(shape)

    def put(self, shape: str, choice: str) -> None:
        """Record a choice; another process's choices written meanwhile are kept."""
        choices = {**self._read(), shape: choice}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps({"key": self.key, "choices": choices}, indent=1, sort_keys=True)
            atomic_write_text(self.path, text)
        except OSError as exc:  # a read-only cache folder: measured again next time
            log.warning("cannot save the measured linear choices to %s (%s)", self.path, exc)

    def _read(self) -> dict[str, str]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        choices = data.get("choices") if isinstance(data, dict) else None
        return choices if isinstance(choices, dict) else {}


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
    ) -> None:
        # A candidate without `make` (torch's, keeping the loaded Linear) can only be forced.
        assert len(candidates) == 1 or all(c.make is not None for c in candidates), candidates
        self.candidates = {c.name: c for c in candidates}
        self.int_candidates = {c.name: c for c in int_candidates}
        # A quantized layer may also be held dense (DENSE), on the fastest dense candidate.
        self.dense_ints = dense_ints
        self.dtype, self.rows, self.cache = dtype, tuple(rows), cache
        self.choices: dict[str, str] = {}
        self.measured = 0  # shapes timed in this process (the rest came from the cache)
        self.seconds = 0.0  # spent timing them

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
        """The module of the choice for `shape`: the only one, the cached one, else each of
        `names` built and timed, the fastest kept (and cached)."""
        chosen = names[0] if len(names) == 1 else self.cache.get(shape)
        if chosen in names:
            self.choices[shape] = chosen
            return build(chosen)
        # Seconds per shape where it must measure (a new CPU, torch or kernel): say which.
        log.info("measuring the linears of shape %s: %s", shape, ", ".join(names))
        start = time.perf_counter()
        made = {name: build(name) for name in names}
        by_rows = [time_linears(made, r, in_f, self.dtype) for r in self.rows]
        timings = {n: [t[n] for t in by_rows] for n in made}
        chosen = fastest(timings)
        self.seconds += time.perf_counter() - start
        self.measured += 1
        self.cache.put(shape, chosen)
        self.choices[shape] = chosen
        return made[chosen]
