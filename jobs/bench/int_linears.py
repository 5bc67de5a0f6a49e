"""The integer-weight linear kernels, with bf16 activations (kernels/cpu_int_linear.cpp) and
with int8 ones (kernels/cpu_a8_linear.cpp, "a8", each vector path its build has), against the
bf16 kernel (kernels/cpu_bf16_linear.cpp) and F.linear in bfloat16, at a 1B-class model's shapes
and the row counts a step has. --dtype float32: the same with float32 rows, against the float32
kernel (kernels/cpu_f32_linear.cpp) and F.linear in float32, as a CPU without native bf16 runs
them; on a CPU above AVX2, as an AVX2 one would (AVX2 builds, torch held to AVX2):

    python -m jobs.bench.int_linears
    python -m jobs.bench.int_linears --rows 1,64 --repeats 50 \
        --out jobs/bench/results/int_linears.json
    python -m batchpage.kernels.lesser_cpu avx2 python -m jobs.bench.int_linears \
        --dtype float32 --group 0 --rows 1,64 --out jobs/bench/results/int_linears_avx2.json

Each cell is the median of --repeats calls after a warm-up, the implementations taking turns
(one call each per round), so that a drift of the machine's speed reaches them alike. "hot"
repeats one weight, which then stays in the caches; "cold" takes enough copies of the weight
in turn (together at least 128 MiB) that every call reads it from memory, as a decode step does.
int4 is 4-bit q, int8 8-bit q, in groups of --group (default 128, AWQ / GPTQ; 0: one group per
output row, as W8A8 checkpoints). Prints Markdown with the CPU model and flags; --out writes JSON.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from batchpage.kernels.cpu_a8_linear import CpuA8Linear, pack_a8_weight
from batchpage.kernels.cpu_bf16_linear import CpuBf16Linear, pack_weight
from batchpage.kernels.cpu_f32_linear import CpuF32Linear
from batchpage.kernels.cpu_f32_linear import pack_weight as pack_f32_weight
from batchpage.kernels.cpu_int_linear import CpuIntLinear, pack_int_weight
from batchpage.quant.int_weight import IntWeight, pack_nibbles
from jobs.bench import report

SHAPES = ((2048, 2048), (2048, 8192), (8192, 2048))  # (K, N): attention, gate / up, down
MAX_COPIES = 64


def random_int_weight(
    bits: int, n: int, k: int, gen: torch.Generator, group: int = 128
) -> IntWeight:
    """q uniform over its range, in groups of `group` inputs (0: one group per row)."""
    group = group or k
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * k**-0.5 / 2 ** (bits - 2)
    offsets = -scales * 2 ** (bits - 1)
    packed = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    return IntWeight(packed, scales, offsets, bits, group, k)


def bf16_call(
    kernel: CpuBf16Linear, dense: torch.Tensor, n: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = pack_weight(dense)
    return lambda x: kernel.linear(x, packed, None, n)


def f32_call(
    kernel: CpuF32Linear, dense: torch.Tensor, n: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = pack_f32_weight(dense)
    return lambda x: kernel.linear(x, packed, None, n)


def int_call(kernel: CpuIntLinear, w: IntWeight) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = pack_int_weight(w)
    return lambda x: kernel.linear(x, packed, None)


def a8_call(kernel: CpuA8Linear, w: IntWeight) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = pack_a8_weight(w)
    return lambda x: kernel.linear(x, packed, None)


def copies_for(nbytes: int, cold: bool) -> int:
    """How many copies of a weight of `nbytes` the cold column takes in turn (1: hot only)."""
    return report.cold_copies(nbytes, MAX_COPIES) if cold else 1


def main(argv: list[str] | None = None) -> None:
    p = report.parser(__doc__, smoke=False)
    p.add_argument("--rows", default="1,8,64,256")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--group", type=int, default=128, help="inputs a group (0: one per row)")
    p.add_argument("--no-cold", action="store_true", help="skip the weights-from-memory columns")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: its own)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ints, a8 = CpuIntLinear.build(), CpuA8Linear.build()
    a8_paths = [path for path in a8.paths if path != "plain"]
    if dtype == torch.bfloat16:
        dense_kernel, dense_label = CpuBf16Linear.build(), "bf16 kernel"
        native = dense_kernel.native and ints.native and "avx512_vnni" in a8_paths
        lacks = "AVX512-BF16 or AVX512-VNNI (--dtype float32 runs on AVX2)"
    else:
        dense_kernel, dense_label = CpuF32Linear.build(), "float32 kernel"
        native = ints.wide_path != "plain" and bool(a8_paths)
        lacks = "AVX2 + FMA"
    if not native:
        p.error(f"this CPU lacks {lacks}: the kernels compared here would be their test loops")
    gen = torch.Generator().manual_seed(0)
    a8_labels = [(f"int{bits} a8 {path}", bits, path) for bits in (4, 8) for path in a8_paths]
    kernels = [dense_label, "int4 kernel", "int8 kernel", *(label for label, _, _ in a8_labels)]
    names = ["F.linear", *kernels]
    cold_names = [] if args.no_cold else kernels
    rows, results = [], []
    for k, n in SHAPES:
        dense = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
        w4 = random_int_weight(4, n, k, gen, args.group)
        w8 = random_int_weight(8, n, k, gen, args.group)
        dense_make = bf16_call if dtype == torch.bfloat16 else f32_call
        # label -> packed copies, each a call on x: the first for "hot", all in turn for "cold"
        makers = {
            dense_label: (partial(dense_make, dense_kernel, dense, n), dense.nbytes),
            "int4 kernel": (partial(int_call, ints, w4), w4.nbytes()),
            "int8 kernel": (partial(int_call, ints, w8), w8.nbytes()),
        }
        for label, bits, path in a8_labels:
            w = w4 if bits == 4 else w8
            makers[label] = (partial(a8_call, a8.with_path(path), w), w.nbytes())
        calls = {
            label: [make() for _ in range(copies_for(nbytes, not args.no_cold))]
            for label, (make, nbytes) in makers.items()
        }
        for m in report.ints(args.rows):
            x = torch.randn(m, k, generator=gen).to(dtype)
            with torch.inference_mode():
                hot: dict[str, Callable[[], object]] = {"F.linear": partial(F.linear, x, dense)}
                hot.update({label: partial(fns[0], x) for label, fns in calls.items()})
                cells = report.in_turns(hot, args.repeats)
                if cold_names:
                    cold: dict[str, Callable[[], object]] = {}
                    for c in cold_names:
                        turns = itertools.cycle(calls[c])
                        cold[f"{c} cold"] = lambda t=turns, x=x: next(t)(x)
                    cells.update(report.in_turns(cold, args.repeats))
            results.append(dict(rows=m, k=k, n=n, **{f"{c} ms": v for c, v in cells.items()}))
            gflop = 2 * m * k * n / 1e9
            order = names + [f"{c} cold" for c in cold_names]
            rows.append(
                [m, f"{k} x {n}"]
                + [f"{cells[c]:.3f} ({gflop / cells[c] * 1e3:.0f})" for c in order]
            )
            done = ", ".join(f"{c} {v:.3f}" for c, v in cells.items())
            report.log(f"{k} x {n}, rows {m}: {done}")
    env = report.environment()
    groups = f"groups of {args.group}" if args.group else "one group per output row"
    report.print_header(f"Integer-weight linears vs {args.dtype}", env, f"median of "
                        f"{args.repeats} calls in turns; int4 and int8 in {groups}; a8: each row "
                        "quantized to int8 in the kernel")  # fmt: skip
    header = ["rows", "in x out"] + [f"{c} ms (GFLOP/s)" for c in names]
    header += [f"{c} cold ms (GFLOP/s)" for c in cold_names]
    print(report.markdown_table(header, rows))
    report.save_results(args.out, env, results, args)


if __name__ == "__main__":
    main()
