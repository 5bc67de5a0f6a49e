"""IntWeight: the one in-memory form of an integer-quantized linear weight, whatever checkpoint
format it came from (AWQ, GPTQ, compressed-tensors, GGUF), and its float64 reference.

Every format's decoder (batchpage/quant/formats/) turns its tensors into this form; every
implementation (the C++ kernel, the Triton kernel, torch's dequantize-then-matmul) repacks it
once, at bind, into its own layout. The form is row-major in the output dimension, so the
shards of a merged linear (q/k/v, gate/up) concatenate along dim 0 as dense weights do.

Values: W[n, k] = scales[n, k // group_size] * q[n, k] + offsets[n, k // group_size], with q an
unsigned integer of `bits` bits stored in `storage_bits` (4: two per byte, k even in the low
nibble; 8: one per byte). A format with zero points z has offsets = -scales * z; a signed
format stores q + 2^(bits - 1) with offsets shifted to match. A K-quant's 5- and 6-bit values
are stored in bytes.

FP8 (`float8`): each byte holds an e4m3 value's bits (torch.float8_e4m3fn), q is that value,
offsets are 0, bits is 8; a checkpoint's block scales are repeated over their rows.

Act order (GPTQ desc_act): `perm` is the input permutation that makes groups contiguous;
the stored columns are W[:, perm], and y = x[:, perm] @ stored.T.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IntWeight:
    packed: torch.Tensor  # uint8 [N, ceil(K / 2)] (storage_bits 4) or [N, K] (8)
    scales: torch.Tensor  # float32 [N, G], G = ceil(K / group_size)
    offsets: torch.Tensor  # float32 [N, G]
    bits: int  # significant bits of q: 4 (4-bit storage) or 5..8 (byte storage)
    group_size: int
    in_features: int  # K
    perm: torch.Tensor | None = None  # int64 [K], act order; None: columns in order
    float8: bool = False  # packed holds float8_e4m3fn bits [N, K], not unsigned integers

    def __post_init__(self) -> None:
        n, k = self.out_features, self.in_features
        groups = -(-k // self.group_size)
        width = -(-k // 2) if self.storage_bits == 4 else k
        assert self.packed.dtype == torch.uint8 and self.packed.shape == (n, width), (
            self.packed.shape,
            (n, width),
        )
        for t in (self.scales, self.offsets):
            assert t.dtype == torch.float32 and t.shape == (n, groups), (t.dtype, t.shape)
        assert 4 <= self.bits <= 8, self.bits
        assert self.perm is None or (self.perm.dtype == torch.int64 and self.perm.shape == (k,))
        assert not self.float8 or self.bits == 8, self.bits

    @property
    def storage_bits(self) -> int:
        return 4 if self.bits == 4 else 8

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.group_size)

    def nbytes(self) -> int:
        tensors = [self.packed, self.scales, self.offsets]
        if self.perm is not None:
            tensors.append(self.perm)
        return sum(t.numel() * t.element_size() for t in tensors)

    def codes(self) -> torch.Tensor:  # uint8 [N, K]: q, in stored column order
        """Every q in a byte. The nibbles are split in uint8: a bind dequantizes every layer
        through this, and a wider integer would take several times the memory traffic."""
        assert not self.float8, "FP8 codes are not integers: read them with dequantize"
        if self.storage_bits == 8:
            return self.packed
        pairs = torch.stack([self.packed & 0xF, self.packed >> 4], dim=2)
        return pairs.view(self.out_features, -1)[:, : self.in_features]

    def values(self) -> torch.Tensor:  # int32 [N, K]: q, in stored column order
        return self.codes().to(torch.int32)

    def dequantize_stored(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """[N, K] in stored column order (W[:, perm] under act order)."""
        if self.float8:
            values = self.packed.view(torch.float8_e4m3fn).to(dtype)
        else:
            values = self.codes().to(dtype)
        n, k, groups = self.out_features, self.in_features, self.num_groups
        padded = groups * self.group_size
        if padded != k:  # a last group cut short: padded to a whole one
            values = torch.nn.functional.pad(values, (0, padded - k))
        # [N, G, group]: each group's scale and offset broadcast over it, no [N, K] gathers;
        # in place, so that the one [N, K] of `dtype` is written once per operation
        grouped = values.reshape(n, groups, -1)
        grouped.mul_(self.scales.to(dtype)[:, :, None]).add_(self.offsets.to(dtype)[:, :, None])
        return grouped.view(n, padded)[:, :k]

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """[N, K] in the checkpoint's column order: the dense weight this stands for."""
        stored = self.dequantize_stored(dtype)
        if self.perm is None:
            return stored
        dense = torch.empty_like(stored)
        dense[:, self.perm] = stored
        return dense

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:  # int64 [R] -> float32 [R, K]
        """Rows `ids` of the dense weight (a tied head's lookups), only their bytes read."""
        rows = IntWeight(
            self.packed[ids], self.scales[ids], self.offsets[ids], self.bits, self.group_size,
            self.in_features, self.perm, self.float8,
        )  # fmt: skip
        return rows.dequantize(torch.float32)


def as_form(w: IntWeight, bits: int, group_size: int) -> IntWeight:
    """`w` in a wider form: values stored for `bits` (>= w.bits), groups of `group_size` (which
    must divide w.group_size); the same weight. Merged linears whose parts a GGUF file stores
    in different types (Q4_K q/k, Q6_K v) share the widest form."""
    if (bits, group_size) == (w.bits, w.group_size):
        return w
    assert bits >= w.bits and w.group_size % group_size == 0, (w.bits, w.group_size, bits)
    assert w.perm is None
    repeat = w.group_size // group_size
    groups = -(-w.in_features // group_size)
    values = w.values()
    packed = pack_nibbles(values) if bits == 4 else values.to(torch.uint8)
    return IntWeight(
        packed,
        w.scales.repeat_interleave(repeat, dim=1)[:, :groups].contiguous(),
        w.offsets.repeat_interleave(repeat, dim=1)[:, :groups].contiguous(),
        bits,
        group_size,
        w.in_features,
    )


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] with values in [0, 16) -> uint8 [N, ceil(K / 2)], k even in the low nibble."""
    assert q.dim() == 2, q.shape
    q = q.to(torch.uint8)
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return q[:, 0::2] | (q[:, 1::2] << 4)


def concat_rows(parts: list[IntWeight]) -> IntWeight:
    """The shards of a merged linear, stacked along the output dimension. Act order needs the
    same permutation in every shard (it is: GPTQ orders a layer's inputs by their Hessian,
    which q/k/v, or gate/up, share)."""
    first = parts[0]
    for p in parts[1:]:
        same = (p.bits, p.group_size, p.in_features, p.float8) == (
            first.bits,
            first.group_size,
            first.in_features,
            first.float8,
        )
        if not same:
            raise ValueError("the shards of a merged linear are quantized differently")
        if (p.perm is None) != (first.perm is None) or (
            p.perm is not None and not torch.equal(p.perm, first.perm)
        ):
            raise ValueError(
                "the shards of a merged linear have different act orders (g_idx); batchpage "
                "runs merged q/k/v and gate/up with one input permutation"
            )
    return IntWeight(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.offsets for p in parts]),
        first.bits,
        first.group_size,
        first.in_features,
        first.perm,
        first.float8,
    )
