"""The integer-weight linear kernels, with bf16 activations (kernels/cpu_int_linear.cpp) and
with int8 ones (kernels/cpu_a8_linear.cpp, "a8"), against the bf16 kernel
(kernels/cpu_bf16_linear.cpp) and F.linear in bfloat16, at a 1B-class model's shapes and the
row counts a step has.

    python -m jobs.bench.int_linears
    python -m jobs.bench.int_linears --rows 1,64 --repeats 50 \
        --out jobs/bench/results/int_linears.json

Each cell is the median of --repeats calls after a warm-up, the implementations taking turns
(one call each per round), so that a drift of the machine's speed reaches them alike. "hot"
repeats one weight, which then stays in the caches; "cold" takes enough copies of the weight
in turn (together at least 128 MiB) that every call reads it from memory, as a decode step does.
int4 is 4-bit q in groups of 128 (AWQ / GPTQ), int8 8-bit q in groups of 128. Prints Markdown
with the CPU model and flags; --out writes JSON.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from batchpage.kernels.cpu_a8_linear import CpuA8Linear, pack_a8_weight
from batchpage.kernels.cpu_bf16_linear import CpuBf16Linear, pack_weight
from batchpage.kernels.cpu_int_linear import CpuIntLinear, pack_int_weight
from batchpage.quant.int_weight import IntWeight, pack_nibbles
from jobs.bench import report

SHAPES = ((2048, 2048), (2048, 8192), (8192, 2048))  # (K, N): attention, gate / up, down
MAX_COPIES = 64


def random_int_weight(bits: int, n: int, k: int, gen: torch.Generator) -> IntWeight:
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = -(-k // 128)
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * k**-0.5 / 2 ** (bits - 2)
    offsets = -scales * 2 ** (bits - 1)
    packed = pack_nibbles(q) if bits == 4 else q.to(torch.uint8)
    return IntWeight(packed, scales, offsets, bits, 128, k)


def bf16_call(
    kernel: CpuBf16Linear, dense: torch.Tensor, n: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = pack_weight(dense)
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
    p.add_argument("--no-cold", action="store_true", help="skip the weights-from-memory columns")
    p.add_argument("--threads", type=int, default=None, help="torch's threads (default: its own)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bf16, ints, a8 = CpuBf16Linear.build(), CpuIntLinear.build(), CpuA8Linear.build()
    if not (bf16.native and ints.native and a8.native):
        p.error(
            "this CPU lacks AVX512-BF16 or AVX512-VNNI: the kernels compared here would be their "
            "test loops"
        )
    gen = torch.Generator().manual_seed(0)
    kernels = ["bf16 kernel", "int4 kernel", "int8 kernel", "int4 a8 kernel", "int8 a8 kernel"]
    names = ["F.linear", *kernels]
    cold_names = [] if args.no_cold else kernels
    rows, results = [], []
    for k, n in SHAPES:
        dense = (torch.randn(n, k, generator=gen) * k**-0.5).to(torch.bfloat16)
        w4, w8 = random_int_weight(4, n, k, gen), random_int_weight(8, n, k, gen)
        # label -> packed copies, each a call on x: the first for "hot", all in turn for "cold"
        makers = {
            "bf16 kernel": (partial(bf16_call, bf16, dense, n), 2 * n * k),
            "int4 kernel": (partial(int_call, ints, w4), w4.nbytes()),
            "int8 kernel": (partial(int_call, ints, w8), w8.nbytes()),
            "int4 a8 kernel": (partial(a8_call, a8, w4), w4.nbytes()),
            "int8 a8 kernel": (partial(a8_call, a8, w8), w8.nbytes()),
        }
        calls = {
            label: [make() for _ in range(copies_for(nbytes, not args.no_cold))]
            for label, (make, nbytes) in makers.items()
        }
        for m in report.ints(args.rows):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
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
    report.print_header("Integer-weight linears vs bf16", env, f"median of {args.repeats} calls "
                        "in turns; int4 and int8 in groups of 128; a8: each row quantized to int8 "
                        "in the kernel")  # fmt: skip
    header = ["rows", "in x out"] + [f"{c} ms (GFLOP/s)" for c in names]
    header += [f"{c} cold ms (GFLOP/s)" for c in cold_names]
    print(report.markdown_table(header, rows))
    report.save_results(args.out, env, results)


if __name__ == "__main__":
    main()
