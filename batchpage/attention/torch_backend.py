"""Paged attention in plain torch: the CPU backend and the reference for the Triton kernels.

Decode rows (one query token) of all sequences are batched into one SDPA call over K/V gathered
through the block tables; rows of sequences with several new tokens (prefill, a prefill chunk,
prefill over a cached prefix) run one SDPA call per sequence with a causal mask offset by the
cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchpage.attention.metadata import AttentionMetadata
from batchpage.cache.kv_cache import KVCache


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [T]
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    max_len: int,
) -> torch.Tensor:  # [B, num_kv_heads, max_len, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]  # [B, nb, bs, kvh, d]
    batch, _, _, kvh, d = blocks.shape
    return blocks.reshape(batch, num_blocks * block_size, kvh, d)[:, :max_len].transpose(1, 2)


class TorchPagedAttention:
    """AttentionBackend over the paged pool, in torch (see backend.py for the contract)."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv: KVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)

        starts = meta.query_start_loc.tolist() if meta.num_seqs else []
        decode = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
        if decode:
            rows = [starts[b] for b in decode]
            out[rows] = self._decode(q[rows], k_cache, v_cache, meta, decode, scale)
        for b, n in enumerate(meta.query_lens_cpu):
            if n > 1:
                s = starts[b]
                out[s : s + n] = self._extend(q[s : s + n], k_cache, v_cache, meta, b, scale)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [Bd, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        seqs: list[int],
        scale: float,
    ) -> torch.Tensor:  # [Bd, num_heads, head_dim]
        lens = [meta.seq_lens_cpu[b] for b in seqs]
        max_len = max(lens)
        tables = meta.block_tables[seqs] if len(seqs) < meta.num_seqs else meta.block_tables
        kc = gather_context(k_cache, tables, max_len)  # [Bd, kvh, L, d]
        vc = gather_context(v_cache, tables, max_len)
        # Keys past a sequence's length are other data (or padding blocks): mask them out.
        lens_t = torch.tensor(lens, device=q.device)
        valid = torch.arange(max_len, device=q.device)[None, :] < lens_t[:, None]  # [Bd, L]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2).to(kc.dtype),  # [Bd, H, 1, d]
            kc,
            vc,
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2).to(q.dtype)

    @staticmethod
    def _extend(
        q: torch.Tensor,  # [n, num_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        b: int,
        scale: float,
    ) -> torch.Tensor:  # [n, num_heads, head_dim]
        n, seq_len = q.shape[0], meta.seq_lens_cpu[b]
        kc = gather_context(k_cache, meta.block_tables[b : b + 1], seq_len)[0]  # [kvh, L, d]
        vc = gather_context(v_cache, meta.block_tables[b : b + 1], seq_len)[0]
        # Query row i sits at position seq_len - n + i and sees keys 0..that position.
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [n, L]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(kc.dtype),  # [H, n, d]
            kc,
            vc,
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1).to(q.dtype)
