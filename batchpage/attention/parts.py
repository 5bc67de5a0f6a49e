"""Paged attention in plain torch, planned once per step: the rows of a step split into parts
that attend together (plan_parts), then every layer attends part by part (attend_parts).

A part is a group of decode rows of similar context length, batched into one SDPA call over K/V
gathered through their block tables (or, when they share leading blocks through the prefix cache
or a fork, a cascade that reads those blocks once); or the new rows of one sequence with several
(prefill, a prefill chunk, prefill over a cached prefix), one SDPA call with a causal mask offset
by its cached context. The torch backend attends every row this way (the CPU backend runs its
rows through C++ kernels instead, cpu_backend.py).

Parts depend on the layer's sliding window (which blocks each row reads, which keys it sees), so
a step plans one set of parts per window its layers use (StepParts). A windowed part gathers only
the blocks from its first row's window start on: the blocks wholly before it are never read.
Windowed decodes take no cascade: each member's window starts at its own place, so a shared
leading block is not a common prefix of what they read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

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
    first: list[int],
    lo: list[int] | None = None,
    prefix: torch.Tensor | None = None,
) -> AttentionPart:
    """One row per sequence of `group` (longest span first): sequence b reads its blocks from
    first[b] on and sees its keys from position lo[b] on (its window start; None: all)."""
    device, bs = tables.device, meta.block_size
    own = [meta.seq_lens_cpu[b] - first[b] * bs for b in group]
    length = max(own)
    nb = -(-length // bs)
    skip = torch.tensor([first[b] for b in group], device=device)[:, None]
    # A shorter member's columns past its last block read that block again (masked out): never
    # the table's padding, which names some other sequence's block, possibly one outside this
    # layer's window or past the table's width.
    last = torch.tensor([-(-meta.seq_lens_cpu[b] // bs) - 1 for b in group], device=device)
    cols = torch.minimum(skip + torch.arange(nb, device=device), last[:, None])
    index = torch.tensor(group, device=device)[:, None]
    keys = torch.arange(length, device=device)[None, :]
    # Keys past a sequence's length are other data (or padding blocks): masked out.
    mask = keys < torch.tensor(own, device=device)[:, None]
    if lo is not None:  # and so are keys before the window, in its first block
        mask &= keys >= torch.tensor([lo[b] for b in group], device=device)[:, None] - skip * bs
    return AttentionPart(
        rows=torch.tensor([starts[b] for b in group], device=device),
        blocks=tables[index, cols].reshape(-1),
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


def plan_parts(meta: AttentionMetadata, window: int | None = None) -> list[AttentionPart]:
    """The step's parts, covering every query row once: decode groups (cascades over shared
    leading blocks first), then one part per sequence with several new tokens. window: the
    layers' sliding window (see backend.StepAttention), None for full attention."""
    if window is not None and window >= meta.max_seq_len:
        window = None  # the window holds every context whole: full attention, cascades and all
    starts = meta.query_start_loc.tolist() if meta.num_seqs else []
    tables = meta.block_tables.long()
    bs = meta.block_size
    parts = []
    decode = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
    if window is None:
        rest: list[int] = []
        for cluster, shared in shared_prefix_clusters(decode, meta):
            if shared == 0:
                rest += cluster
                continue
            prefix = tables[cluster[0], :shared]
            for group in length_groups(cluster, meta.seq_lens_cpu):
                first = [shared] * meta.num_seqs
                parts.append(_decode_part(group, starts, tables, meta, first, prefix=prefix))
        for group in length_groups(rest, meta.seq_lens_cpu):
            parts.append(_decode_part(group, starts, tables, meta, [0] * meta.num_seqs))
    else:
        # A decode row at position L - 1 sees keys L - window .. L - 1.
        lo = [max(0, length - window) for length in meta.seq_lens_cpu]
        first = [start // bs for start in lo]
        spans = tuple(length - f * bs for length, f in zip(meta.seq_lens_cpu, first, strict=True))
        for group in length_groups(decode, spans):
            parts.append(_decode_part(group, starts, tables, meta, first, lo))
    extend = [b for b, n in enumerate(meta.query_lens_cpu) if n > 1]
    return parts + extend_parts(meta, extend, window)


def extend_parts(
    meta: AttentionMetadata, seqs: list[int], window: int | None
) -> list[AttentionPart]:
    """One part per sequence of `seqs` (each with several new rows): its rows causal, or bounded
    by meta.key_end where the sequence is one of meta.span_seqs (metadata.py)."""
    lens = meta.query_lens_cpu
    starts = [0, *accumulate(lens)]  # query_start_loc's, from the host copy
    tables = meta.block_tables.long()
    return [_extend_part(b, lens[b], starts[b], tables, meta, window) for b in seqs]


def _extend_part(
    b: int,
    n: int,
    start: int,
    tables: torch.Tensor,
    meta: AttentionMetadata,
    window: int | None,
) -> AttentionPart:
    """Sequence b's n new rows, reading its blocks from its first row's window start on; each
    row sees keys up to its own position, or up to its key_end (meta.key_end)."""
    device, bs = tables.device, meta.block_size
    length = meta.seq_lens_cpu[b]
    # Query row i sits at position p = length - n + i and sees keys 0..p, or p - window + 1..p.
    lo = 0 if window is None else max(0, length - n - window + 1)
    first = lo // bs
    q_pos = torch.arange(length - n, length, device=device)[:, None]
    k_pos = torch.arange(first * bs, length, device=device)[None, :]
    if meta.key_end is not None and b in meta.span_seqs:  # rows of an image span see it whole
        mask = k_pos < meta.key_end[start : start + n, None]
    else:
        mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return AttentionPart(
        rows=torch.arange(start, start + n, device=device),
        blocks=tables[b, first : -(-length // bs)],
        num_seqs=1,
        num_queries=n,
        length=length - first * bs,
        mask=mask[None, None],
    )


@dataclass
class StepParts:
    """One step's parts per sliding window, planned when a layer with that window first asks and
    then reused by every later layer with it (the metadata is the same for all layers)."""

    meta: AttentionMetadata
    planned: dict[int | None, list[AttentionPart]] = field(default_factory=dict)

    def __call__(self, window: int | None) -> list[AttentionPart]:
        if window is not None and window >= self.meta.max_seq_len:
            window = None  # the same parts as full attention: plan them once
        if window not in self.planned:
            self.planned[window] = plan_parts(self.meta, window)
        return self.planned[window]


def gather_keys(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    part: AttentionPart,
) -> torch.Tensor:  # [Bg, num_kv_heads, L, head_dim]
    _, bs, kvh, d = cache.shape
    # index_select on the 4-D pool copies whole blocks per index: on CPU a copy through a 2-D
    # view of the pool was slower.
    blocks = cache.index_select(0, part.blocks)  # [Bg * nb, bs, kvh, d]
    return blocks.view(part.num_seqs, -1, kvh, d)[:, : part.length].transpose(1, 2)


def cascade_decode(
    q: torch.Tensor,  # [G, H, d]: one query row per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, kvh, d]
    v_cache: torch.Tensor,
    part: AttentionPart,
    scale: float,
    softcap: float | None = None,
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
    if softcap is not None:
        s_pre, s_own = soft_cap(s_pre, softcap), soft_cap(s_own, softcap)
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


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(scores / cap)


def capped_attention(
    q: torch.Tensor,  # [Bg, H, n, d]
    k: torch.Tensor,  # [Bg, kvh, L, d]
    v: torch.Tensor,  # [Bg, kvh, L, d]
    mask: torch.Tensor,  # bool [Bg, 1, n, L]
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [Bg, H, n, d], float32
    """SDPA's attention with the scores soft-capped before the mask, which SDPA cannot do;
    float32 throughout. Query head h reads kv head h // group, as SDPA's enable_gqa."""
    bg, heads, n, d = q.shape
    kvh = k.shape[1]
    group = heads // kvh
    qf = q.float().reshape(bg, kvh, group * n, d)
    s = soft_cap(torch.matmul(qf, k.float().transpose(-1, -2)) * scale, softcap)
    s = s.view(bg, kvh, group, n, -1).masked_fill(~mask[:, :, None], -math.inf)
    p = s.softmax(-1).view(bg, kvh, group * n, -1)
    return torch.matmul(p, v.float()).view(bg, heads, n, d)


def attend_parts(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    parts: list[AttentionPart],
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]: the parts' rows are written
    softcap: float | None = None,
) -> None:
    """One layer's attention for the rows the parts cover, over the pool's K/V (the step's new
    tokens already written to it); softcap: scores become softcap * tanh(scores / softcap)."""
    heads, d = q.shape[1:]
    for part in parts:
        if part.prefix_blocks is not None:
            qc = q.index_select(0, part.rows)
            o = cascade_decode(qc, k_cache, v_cache, part, scale, softcap)
            out.index_copy_(0, part.rows, o.to(q.dtype))
            continue
        qg = q.index_select(0, part.rows).view(part.num_seqs, part.num_queries, heads, d)
        qg = qg.transpose(1, 2).to(k_cache.dtype)  # [Bg, H, n, d]
        keys, values = gather_keys(k_cache, part), gather_keys(v_cache, part)
        if softcap is None:
            o = F.scaled_dot_product_attention(
                qg, keys, values, attn_mask=part.mask, scale=scale, enable_gqa=True
            )  # [Bg, H, n, d]
        else:
            o = capped_attention(qg, keys, values, part.mask, scale, softcap)
        out.index_copy_(0, part.rows, o.transpose(1, 2).reshape(-1, heads, d).to(q.dtype))
