"""The default KV pool is cut from the memory the machine can give (MemAvailable, less the
model's weights), not from MemFree, which the page cache eats after reading a few files; a pool
too small for the model's whole context caps an unset max_model_len with a warning.

The machine's memory figures are replaced by files written here, so the figures asserted do not
depend on what else runs on the machine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from batchpage import host_memory
from batchpage.cache.kv_cache import bytes_per_block
from batchpage.engine.config import EngineConfig
from batchpage.engine.plan import PoolTooSmall, plan_engine
from batchpage.model.loader import ModelSource, resolve_model_source

GIB = 1 << 30


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Sets the machine's memory: free(mem_free, mem_available) writes /proc/meminfo's two
    figures (in kB, as the kernel writes them: give multiples of 1024); free physical pages
    (sysconf) are mem_free too, as the kernel counts them."""
    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "CGROUP", tmp_path / "no-cgroup")
    real_sysconf = os.sysconf

    def free(mem_free: int, mem_available: int) -> None:
        meminfo.write_text(
            f"MemTotal:       {64 * GIB // 1024} kB\nMemFree:        {mem_free // 1024} kB\n"
            f"MemAvailable:   {mem_available // 1024} kB\nBuffers:          1024 kB\n"
        )
        pages = mem_free // real_sysconf("SC_PAGE_SIZE")
        monkeypatch.setattr(
            os, "sysconf", lambda name: pages if name == "SC_AVPHYS_PAGES" else real_sysconf(name)
        )

    return free


@pytest.fixture(scope="module")
def tiny_source(tiny_folder: Path) -> ModelSource:
    return resolve_model_source(str(tiny_folder))


def per_block(source: ModelSource, block_size: int = 16) -> int:
    c = source.config
    return bytes_per_block(c.num_layers, block_size, c.num_kv_heads, c.head_dim, torch.float32)


def test_the_default_pool_comes_from_mem_available_less_the_weights(machine, tiny_source):
    # The page cache holds nearly all memory: MemFree is 64 MiB, 16 GiB could be had.
    machine(64 << 20, 16 * GIB)
    plan = plan_engine(EngineConfig(dtype="float32", device="cpu"), tiny_source)
    weights = tiny_source.num_weights * 4
    assert weights > 0
    assert plan.kv_cache_bytes == int((16 * GIB - weights) * 0.1)
    assert plan.max_model_len == tiny_source.config.max_model_len


def test_a_pool_too_small_for_the_whole_context_caps_an_unset_max_model_len(machine, tiny_source):
    blocks = 100  # 1600 tokens of the model's 2048: capped to 1024, a power of two
    weights = tiny_source.num_weights * 4
    left = 10 * blocks * per_block(tiny_source) + 1024  # 0.1 of it: 100 blocks and 102 bytes
    machine(1 << 20, weights + left)
    with pytest.warns(UserWarning, match="max_model_len is set to 1024; raise kv_cache_memory"):
        plan = plan_engine(EngineConfig(dtype="float32", device="cpu"), tiny_source)
    assert (plan.num_blocks, plan.max_model_len) == (blocks, 1024)
    # Asked for by the user, the full length is refused, naming the fix.
    cfg = EngineConfig(dtype="float32", device="cpu", max_model_len=2048)
    with pytest.raises(PoolTooSmall, match="raise kv_cache_memory or lower max_model_len"):
        plan_engine(cfg, tiny_source)


def test_weights_or_a_pool_beyond_the_available_memory_are_refused(machine, tiny_source):
    weights = tiny_source.num_weights * 4
    machine(1 << 20, weights // 1024 * 1024 - 1024)
    with pytest.raises(ValueError, match=r"weights take .* more than the .*\(MemAvailable\)"):
        plan_engine(EngineConfig(dtype="float32", device="cpu"), tiny_source)
    machine(1 << 20, 2 * GIB)
    cfg = EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 * GIB)
    with pytest.raises(PoolTooSmall, match="kv_cache_memory=4294967296 bytes .* lower kv_cache"):
        plan_engine(cfg, tiny_source)


def test_a_cgroup_limit_caps_the_available_memory(tmp_path: Path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemFree: 1024 kB\nMemAvailable: {16 * GIB // 1024} kB\n")
    group = tmp_path / "cgroup"
    group.mkdir()
    (group / "memory.max").write_text(f"{4 * GIB}\n")
    (group / "memory.current").write_text(f"{3 * GIB}\n")
    (group / "memory.stat").write_text(f"anon {2 * GIB}\ninactive_file {GIB // 2}\n")
    assert host_memory.available_host_memory(meminfo, group) == GIB + GIB // 2
    (group / "memory.max").write_text("max\n")
    assert host_memory.available_host_memory(meminfo, group) == 16 * GIB
