"""Paged attention in plain torch, planned once per step: the rows of a step split into parts
that attend together (plan_parts), then every layer attends part by part (attend_parts).

A part is a group of decode rows of similar context length, batched into one SDPA call over K/V
gathered through their block tables (or, when they share leading blocks through the prefix cache
or a fork, a cascade that reads those blocks once); or the new rows of one sequence with several
(prefill, a prefill chunk, prefill over a cached prefix), one SDPA call with a causal mask offset
by its cached context. The torch backend attends every row this way; the CPU backend only the
rows its C++ decode kernel does not serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchpage.attention.metadata import AttentionMetadata


def length_groups(
    seqs: list[int], seq_lens: tuple[int, ...], slack: float = 1.25
) -> list[list[int]]:
    """Split decode sequences into groups of similar context length.

    A group's K/V is gathered and attended padded to its longest member, so mixing a 50-token
    context with a 2000-token one costs 40x for the short one. Longest first, a group takes
    members while its padded size stays within `slack` times what its members really hold.
    """
    ordered = sorted(seqs, key=lambda b: -seq_lens[b])
    groups: list[list[int]] = []
    held = 0
    for b in ordered:
        if groups and (len(groups[-1]) + 1) * seq_lens[groups[-1][0]] <= slack * (
            held + seq_lens[b]
        ):
            groups[-1].append(b)
            held += seq_lens[b]
        else:
            groups.append([b])
            held = seq_lens[b]
    return groups


@dataclass(frozen=True)
class AttentionPart:
    """Query rows that attend together: a group of decodes (one row each) or one sequence's new
    tokens. plan_parts builds a step's parts from its metadata alone, once, and attend_parts then
    runs them for every layer; the tensors live on the metadata's device."""

    rows: torch.Tensor  # int64 [Bg * n]: rows of q / out, sequence-major
    blocks: torch.Tensor  # int64 [Bg * nb]: the block ids to gather, sequence-major
    num_seqs: int  # Bg
    num_queries: int  # n: query rows per sequence
    length: int  # L: keys gathered per sequence (the longest context in the part)
    mask: torch.Tensor  # bool [Bg, 1, n, L]: which keys each query row sees
    # Cascade decode: blocks every sequence of the part holds (the same block ids, shared through
    # the prefix cache or a fork) are read once for all of them; `blocks`, `length` and `mask`
    # then describe each sequence's own tokens after that prefix.
    prefix_blocks: torch.Tensor | None = None  # int64 [P]


def _decode_part(
    group: list[int],
    starts: list[int],
    tables: torch.Tensor,
    meta: AttentionMetadata,
    skip: int = 0,
    prefix: torch.Tensor | None = None,
) -> AttentionPart:
    """One row per sequence of `group` (longest first), reading blocks from `skip` on."""
    device, bs = tables.device, meta.block_size
    own = [meta.seq_lens_cpu[b] - skip * bs for b in group]
    length = own[0]
    nb = -(-length // bs)
    index = torch.tensor(group, device=device)
    # Keys past a sequence's length are other data (or padding blocks): masked out.
    mask = torch.arange(length, device=device)[None, :] < torch.tensor(own, device=device)[:, None]
    return AttentionPart(
        rows=torch.tensor([starts[b] for b in group], device=device),
        blocks=tables[index, skip : skip + nb].reshape(-1),
        num_seqs=len(group),
        num_queries=1,
        length=length,
        mask=mask[:, None, None, :],
        prefix_blocks=prefix,
    )


def shared_prefix_clusters(
    decode: list[int], meta: AttentionMetadata, min_size: int = 4
) -> list[tuple[list[int], int]]:
    """Decode sequences whose block tables start with the same block ids, with the number of
    such leading full blocks (0: not worth a cascade). Only whole blocks inside every member's
    context count, so the shared part is identical K/V for all of them."""
    bs = meta.block_size
    by_first: dict[int, list[int]] = {}
    for b in decode:
        if meta.seq_lens_cpu[b] > bs:
            by_first.setdefault(int(meta.block_tables[b, 0]), []).append(b)
    clusters, seen = [], set()
    for members in by_first.values():
        if len(members) < min_size:
            continue
        full = (min(meta.seq_lens_cpu[b] for b in members) - 1) // bs  # >= 1 own token each
        rows = meta.block_tables[members, :full]
        same = (rows == rows[0]).all(dim=0)
        shared = int(full if bool(same.all()) else same.int().argmin())
        clusters.append((members, shared))
        seen.update(members)
    clusters.append(([b for b in decode if b not in seen], 0))
    return clusters


def plan_parts(meta: AttentionMetadata, decode_rows: bool = True) -> list[AttentionPart]:
    """The step's parts, covering every query row once: decode groups (cascades over shared
    leading blocks first), then one part per sequence with several new tokens.

    decode_rows=False leaves out the sequences with one new token (a backend that serves them
    some other way plans only the rest)."""
    starts = meta.query_start_loc.tolist() if meta.num_seqs else []
    tables = meta.block_tables.long()
    device = meta.block_tables.device
    bs = meta.block_size
    parts = []
    decode = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1] if decode_rows else []
    rest: list[int] = []
    for cluster, shared in shared_prefix_clusters(decode, meta):
        if shared == 0:
            rest += cluster
            continue
        prefix = tables[cluster[0], :shared]
        for group in length_groups(cluster, meta.seq_lens_cpu):
            parts.append(_decode_part(group, starts, tables, meta, skip=shared, prefix=prefix))
    for group in length_groups(rest, meta.seq_lens_cpu):
        parts.append(_decode_part(group, starts, tables, meta))
    for b, n in enumerate(meta.query_lens_cpu):
        if n > 1:
            length = meta.seq_lens_cpu[b]
            # Query row i sits at position length - n + i and sees keys 0..that position.
            q_pos = torch.arange(length - n, length, device=device)
            mask = torch.arange(length, device=device)[None, :] <= q_pos[:, None]
            parts.append(
                AttentionPart(
                    rows=torch.arange(starts[b], starts[b] + n, device=device),
                    blocks=tables[b, : -(-length // bs)],
                    num_seqs=1,
                    num_queries=n,
                    length=length,
                    mask=mask[None, None],
                )
            )
    return parts


def gather_keys(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    part: AttentionPart,
) -> torch.Tensor:  # [Bg, num_kv_heads, L, head_dim]
    _, bs, kvh, d = cache.shape
    # index_select on the 4-D pool copies whole blocks per index; on a 2-D view of it the same
    # copy runs about 2.5x slower on CPU.
    blocks = cache.index_select(0, part.blocks)  # [Bg * nb, bs, kvh, d]
    return blocks.view(part.num_seqs, -1, kvh, d)[:, : part.length].transpose(1, 2)


def cascade_decode(
    q: torch.Tensor,  # [G, H, d]: one query row per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kvh, d]
    v_cache: torch.Tensor,
    part: AttentionPart,
    scale: float,
) -> torch.Tensor:  # [G, H, d], float32
    """Attention over [shared prefix | own tokens] with the prefix's K/V read once for all G
    sequences: softmax over both pieces, merged through their running maxima."""
    assert part.prefix_blocks is not None
    g_seqs, heads, d = q.shape
    kvh = k_cache.shape[2]
    group = heads // kvh
    qf = q.float().view(g_seqs, kvh, group, d)
    kp = k_cache.index_select(0, part.prefix_blocks).view(-1, kvh, d).float()  # [P, kvh, d]
    vp = v_cache.index_select(0, part.prefix_blocks).view(-1, kvh, d).float()
    # Prefix: every sequence's queries against one K: [kvh, G*group, d] @ [kvh, d, P].
    q_by_head = qf.permute(1, 0, 2, 3).reshape(kvh, g_seqs * group, d)
    s_pre = torch.bmm(q_by_head, kp.permute(1, 2, 0)) * scale  # [kvh, G*group, P]
    s_pre = s_pre.view(kvh, g_seqs, group, -1).permute(1, 0, 2, 3)  # [G, kvh, group, P]
    # Own tokens: gathered per sequence, as in the plain path.
    ks = gather_keys(k_cache, part).float()  # [G, kvh, S, d]
    vs = gather_keys(v_cache, part).float()
    s_own = torch.matmul(qf, ks.transpose(-1, -2)) * scale  # [G, kvh, group, S]
    s_own = s_own.masked_fill(~part.mask, float("-inf"))
    top = torch.maximum(s_pre.amax(-1, keepdim=True), s_own.amax(-1, keepdim=True))
    p_pre, p_own = (s_pre - top).exp(), (s_own - top).exp()
    denom = p_pre.sum(-1, keepdim=True) + p_own.sum(-1, keepdim=True)
    pv_pre = (
        torch.bmm(p_pre.permute(1, 0, 2, 3).reshape(kvh, g_seqs * group, -1), vp.permute(1, 0, 2))
        .view(kvh, g_seqs, group, d)
        .permute(1, 0, 2, 3)
    )  # [G, kvh, group, d]
    o = (pv_pre + torch.matmul(p_own, vs)) / denom
    return o.reshape(g_seqs, heads, d)


def attend_parts(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    parts: list[AttentionPart],
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]: the parts' rows are written
) -> None:
    """One layer's attention for the rows the parts cover, over the pool's K/V (the step's new
    tokens already written to it)."""
    heads, d = q.shape[1:]
    for part in parts:
        if part.prefix_blocks is not None:
            o = cascade_decode(q.index_select(0, part.rows), k_cache, v_cache, part, scale)
            out.index_copy_(0, part.rows, o.to(q.dtype))
            continue
        qg = q.index_select(0, part.rows).view(part.num_seqs, part.num_queries, heads, d)
        o = F.scaled_dot_product_attention(
            qg.transpose(1, 2).to(k_cache.dtype),  # [Bg, H, n, d]
            gather_keys(k_cache, part),
            gather_keys(v_cache, part),
            attn_mask=part.mask,
            scale=scale,
            enable_gqa=True,
        )  # [Bg, H, n, d]
        out.index_copy_(0, part.rows, o.transpose(1, 2).reshape(-1, heads, d).to(q.dtype))
