"""The exponential race: a sampled token from each row's probabilities and its draw key, with
no generator: token v wins where probs[v] / E[v] is largest, E[v] ~ Exp(1) a hash of the row's
key and v, so v wins with probability probs[v] (the first on ties), the same in any batch, after
a recompute and on every rank. The torch implementation of LayerOps.race and the reference of
the CPU kernel's (kernels/cpu_layer_ops.cpp `race_rows`); the keys are sampler.draw_keys.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (c split in halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors of 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [N, vocab], Exp(1) per element: -log(u), u = ((h >> 9) + 0.5) / 2**23 (exact in
    float32, in (0, 1)), h = fmix32(key ^ (v * 0x9E3779B9 mod 2**32))."""
    tokens = _mul32(torch.arange(vocab, dtype=torch.int64, device=keys.device), 0x9E3779B9)
    h = _fmix32(keys[:, None] ^ tokens[None, :])
    u = ((h >> 9).to(torch.float32) + 0.5) * (2.0**-23)
    return -torch.log(u)


def exponential_race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """int64 [N]: each row's token v maximising probs[v] / race_noise[v] (the first on ties; a
    token of zero probability never, while any has more): token v with probability probs[v].
    The reference of the CPU kernels' `race` (kernels/cpu_layer_ops.cpp)."""
    return (probs / race_noise(keys.to(probs.device), probs.shape[1])).argmax(dim=-1)
