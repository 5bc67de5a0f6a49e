"""Devices the simulator knows: datasheet peaks (dense FLOP/s at the dtype, memory bandwidth,
the link between a node's devices), and this machine's CPU from what /proc/cpuinfo says.

Peaks are the vendors' published figures (dense, no sparsity): how far from them the engine runs
is not a device constant but an `Efficiency` fitted to measured runs (jobs/bench/simulated.py
fit).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

from batchpage.cpu_info import cpu_flags, cpu_mhz, cpu_model, has_native_bf16


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    flops: float  # dense FLOP/s at the dtype that runs (bf16 on GPUs)
    bandwidth: float  # bytes/s of memory
    memory: float  # bytes of memory a device
    link_bandwidth: float = 0.0  # bytes/s one way between two devices of a node
    link_latency_s: float = 0.0  # per all-reduce
    max_tp: int = 1  # devices in a node
    host_bandwidth: float = 0.0  # bytes/s to host memory and back (a swap); 0: the bandwidth
    # A step's compute and memory traffic overlap (its time the larger: a GPU's); False: it pays
    # both (CPU cores that stall on the reads they do not prefetch, the calibrated CPU's).
    overlap: bool = True


# NVIDIA's datasheets: H100 SXM5 (989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s
# both ways), A100 SXM4 80GB (312 TFLOP/s, 2.04 TB/s, NVLink 600 GB/s), H200 SXM (989 TFLOP/s,
# 4.8 TB/s, 141 GB); eight to a node (HGX). NVLink all-reduce latency: a few microseconds.
# Host link: PCIe Gen5 x16 (64 GB/s one way) for H100 and H200, Gen4 (32 GB/s) for A100.
# L4 (NVIDIA L4 Tensor Core GPU datasheet): 121 TFLOP/s bf16 dense (242 with sparsity), 300 GB/s
# GDDR6, 24 GB, PCIe Gen4 x16 and no NVLink, so its all-reduces cross PCIe (32 GB/s one way);
# up to eight to a server (e.g. 8-GPU L4 cloud instances).
GPUS = {
    "h100": DeviceSpec("h100", 989e12, 3.35e12, 80e9, 450e9, 8e-6, 8, 64e9),
    "a100-80gb": DeviceSpec("a100-80gb", 312e12, 2.039e12, 80e9, 300e9, 8e-6, 8, 32e9),
    "h200": DeviceSpec("h200", 989e12, 4.8e12, 141e9, 450e9, 8e-6, 8, 64e9),
    "l4": DeviceSpec("l4", 121e12, 300e9, 24e9, 32e9, 20e-6, 8, 32e9),
}
# torch.cuda.get_device_name() words -> the datasheet of that GPU (for `this` on a GPU).
_CUDA_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb"), ("L4", "l4"))


def this_cpu(dtype_bytes: int, threads: int | None = None, overlap: bool = True) -> DeviceSpec:
    """This machine's cores as one device: two FMA pipes a core at the lanes its widest vector
    unit holds (AVX-512: 16 float32, AVX2: 8), twice that for bf16 where the CPU has native bf16
    dot products; the bandwidth a nominal 10 GB/s a core (the fitted efficiency takes the
    truth); memory what the OS reports."""
    flags = cpu_flags()
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags else 4
    per_cycle = 2 * 2 * lanes * (2 if dtype_bytes == 2 and has_native_bf16(flags) else 1)
    mhz = cpu_mhz()
    cores = threads or os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    name = f"cpu ({cpu_model()})"
    return DeviceSpec(name, cores * mhz * 1e6 * per_cycle, cores * 10e9, memory, overlap=overlap)


def cuda_datasheet(cuda_name: str) -> DeviceSpec | None:
    """The datasheet of a GPU by its CUDA name ("NVIDIA H100 80GB HBM3"), or None."""
    return next((GPUS[ours] for word, ours in _CUDA_NAMES if word in cuda_name.split()), None)


class DeviceName(NamedTuple):
    name: str  # a datasheet GPU, "this", or a device file (.json)
    tp: int  # devices a replica spans (tensor parallelism)

    @property
    def label(self) -> str:
        return self.name if self.tp == 1 else f"{self.name}:tp{self.tp}"


def parse_device(text: str) -> DeviceName:
    """`name` or `name:tpN` (N devices of a node, tensor parallel): a datasheet GPU (h100,
    a100-80gb, h200, l4), `this` (this machine, its step cost measured) or a device file (a
    .json path: a measured device). ValueError naming the known ones."""
    name, sep, tp = text.strip().partition(":tp")
    if sep and not (tp.isdigit() and int(tp) >= 1):
        raise ValueError(f"device {text!r}: give name:tpN with N >= 1 devices, e.g. h100:tp8")
    if name not in GPUS and name != "this" and not name.endswith(".json"):
        raise ValueError(
            f"device {text!r} is not one the estimate knows: {', '.join([*GPUS, 'this'])}, or a "
            "device file (.json, e.g. a calibration copied from another machine)"
        )
    return DeviceName(name, int(tp or 1))


def device(name: str, dtype_bytes: int = 2) -> DeviceSpec:
    """A named device: h100, a100-80gb, h200, l4, or cpu (this machine)."""
    if name == "cpu":
        return this_cpu(dtype_bytes)
    if name not in GPUS:
        raise ValueError(
            f"device={name!r} is not one the simulator knows: {', '.join([*GPUS, 'cpu'])}"
        )
    return GPUS[name]
