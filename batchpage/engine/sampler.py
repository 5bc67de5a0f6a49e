"""The batched sampler: one new token per sequence from one step's logits.

Processing follows HF transformers / vLLM, in this order:

0. structured outputs: tokens outside a constrained row's grammar get -inf (``token_mask``, the
   packed bitmask xgrammar fills; see batchpage.engine.constraint);
1. logit_bias (added to the logits);
2. min_tokens: EOS and stop_token_ids get -inf while the output is shorter than min_tokens;
3. repetition_penalty (HF/CTRL semantics, over prompt + output tokens: positive logits are divided
   by the penalty, negative ones multiplied);
4. presence_penalty / frequency_penalty (OpenAI semantics, over output tokens only);
5. greedy rows (temperature 0 or top_k 1) take the argmax; sampled rows go through temperature,
   top_k, top_p, min_p and then draw a token.

Logprobs are those of the raw model output (log_softmax of the logits as given, before any of the
steps above), which is vLLM's default ``logprobs_mode="raw_logprobs"``: they describe the model, not
the sampling settings, and the same number comes back whatever the request's temperature.

Work is vectorised across rows from their settings as arrays (RowParams: the engine's
InputBatch keeps them as columns, written when a row joins); each processing step touches only
the rows that need it, and a batch of plain greedy rows is a single argmax over the logits (the
hot path). Python walks rows one by one only for what a row carries as lists: its logit_bias,
penalties and min_tokens (their token histories: `Penalties`, given for those rows alone).

Randomness: a sampled row draws its token with the exponential race (argmax of probs / E, E ~
Exp(1) i.i.d. per token, which picks token i with probability probs[i]). Its noise is
counter-based: E[v] comes from a hash of the row's draw key and v (ops/race.py), the key from
the row's seed and the position of the token it draws (`draw_keys`). No generator, no state:
one pass for every sampled row (the CPU kernels' `race` computes the noise inside the argmax),
the same token for the same logits whatever else shares the batch and after a recompute, and a
last-bit change of the logits (another tensor_parallel_size) moves a token only when two
candidates' ratios tie that closely. (A draw inverting the CDF at one hashed uniform was tried
and dropped: every token boundary of a CDF is a place where a last-bit change flips it.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import NamedTuple

import numpy as np
import torch
import xgrammar as xgr

from batchpage.ops.race import exponential_race
from batchpage.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class TopLogprobs(NamedTuple):
    """Logprobs for one generated (or prompt) position."""

    token_id: int  # the chosen token
    logprob: float  # its logprob
    rank: int  # 1 + number of tokens with a strictly higher logprob
    top_ids: list[int]  # the most likely tokens, best first (len = the requested count)
    top_logprobs: list[float]


class TokenMask(NamedTuple):
    """Allowed tokens of some rows: xgrammar's packed bitmask (int32 [N, ceil(V / 32)] on the
    CPU; bit j of word w allows token 32 * w + j) and the logits rows it applies to."""

    bitmask: torch.Tensor
    rows: list[int]


class RowParams(NamedTuple):
    """Each logits row's sampling settings as arrays, one entry per row."""

    greedy: np.ndarray  # bool: temperature 0 or top_k 1 (SamplingParams.is_greedy)
    # bool: logit_bias, min_tokens or a penalty, which read the row's SamplingParams and
    # token histories
    processed: np.ndarray
    temperature: np.ndarray  # float64 (1.0 where greedy: never applied)
    top_k: np.ndarray  # int64; 0: the whole vocabulary
    top_p: np.ndarray  # float64
    min_p: np.ndarray  # float64
    logprobs: np.ndarray  # int64: top logprobs to report; -1: none

    @classmethod
    def of(cls, params: Sequence[SamplingParams]) -> RowParams:
        return cls(
            np.array([p.is_greedy for p in params], dtype=bool),
            np.array([_needs_processing(p) for p in params], dtype=bool),
            np.array([1.0 if p.is_greedy else p.temperature for p in params], dtype=np.float64),
            np.array([max(p.top_k, 0) for p in params], dtype=np.int64),
            np.array([p.top_p for p in params], dtype=np.float64),
            np.array([p.min_p for p in params], dtype=np.float64),
            np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int64),
        )

    def take(self, rows: np.ndarray) -> RowParams:
        return RowParams(*(column[rows] for column in self))


class Penalties(NamedTuple):
    """What the rows with logit_bias, min_tokens or penalties (RowParams.processed) read as
    lists, one entry per such row: its logits row, params, prompt and output tokens, and the
    ids that end it (masked under min_tokens unless ignore_eos)."""

    rows: list[int]
    params: list[SamplingParams]
    prompt_ids: list[Sequence[int]]
    output_ids: list[Sequence[int]]
    eos_ids: list[Collection[int]]

    @classmethod
    def of(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        eos_ids: Sequence[Collection[int]] | None = None,
    ) -> Penalties:
        """Of every row that needs them, from lists with one entry per row."""
        rows = [i for i, p in enumerate(params) if _needs_processing(p)]
        eos = eos_ids if eos_ids is not None else [()] * len(params)
        return cls(
            rows,
            [params[i] for i in rows],
            [prompt_ids[i] for i in rows],
            [output_ids[i] for i in rows],
            [eos[i] for i in rows],
        )


_SPLITMIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


def draw_keys(seeds: np.ndarray, positions: np.ndarray) -> torch.Tensor:
    """int64 [N]: each row's 32-bit draw key, the top half of a SplitMix64 step over its seed
    and the position of the token it draws (numpy's uint64 arithmetic wraps)."""
    golden, m1, m2 = (np.uint64(c) for c in _SPLITMIX)
    x = seeds.astype(np.uint64) + (positions.astype(np.uint64) + np.uint64(1)) * golden
    x = (x ^ (x >> np.uint64(30))) * m1
    x = (x ^ (x >> np.uint64(27))) * m2
    x = x ^ (x >> np.uint64(31))
    return torch.from_numpy((x >> np.uint64(32)).astype(np.int64))


class SamplerOutput(NamedTuple):
    token_ids: list[int]  # one per row
    logprobs: list[TopLogprobs | None]  # None where the row's params.logprobs is None


def sample(
    logits: torch.Tensor,
    rows: RowParams,
    keys: torch.Tensor,
    penalties: Penalties | None = None,
    token_mask: TokenMask | None = None,
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = exponential_race,
) -> SamplerOutput:
    """Pick one token per row of ``logits`` [N, V]; the input tensor is never modified.

    ``rows``: each row's settings (RowParams); ``keys``: int64 [N], each row's draw key
    (draw_keys), read for sampled rows. ``penalties``: the lists of the rows
    RowParams.processed marks (None when none is). ``argmax`` replaces
    ``logits.argmax(dim=-1)`` on the all-greedy hot path and ``race`` exponential_race (the CPU
    engine passes the C++ ones of kernels/cpu_layer_ops.py, the same results and faster).

    ``token_mask`` restricts its rows to the tokens it allows; the other rows are untouched, so
    they get the same token whether or not constrained rows share their batch.
    """
    n = logits.shape[0]
    if not len(rows.greedy) == len(keys) == n:
        raise ValueError(
            f"sample() needs one entry per logits row ({n}); got rows={len(rows.greedy)}, "
            f"keys={len(keys)}"
        )
    process = bool(rows.processed.any())
    covered = penalties.rows if penalties is not None else []
    if covered != np.flatnonzero(rows.processed).tolist():
        raise ValueError("sample(): penalties must cover the rows RowParams.processed marks")
    all_greedy = bool(rows.greedy.all())
    wants = bool((rows.logprobs >= 0).any())
    if all_greedy and not process and token_mask is None and not wants:
        return sample_greedy(logits, argmax)
    if all_greedy and not process and token_mask is None:
        tokens = logits.argmax(dim=-1) if argmax is None else argmax(logits)
    else:
        work = logits.float()
        if process or token_mask is not None:
            work = work.clone() if work is logits else work
        if token_mask is not None:
            apply_token_mask(work, token_mask)
        if penalties is not None:
            apply_penalties(work, penalties)
        tokens = _choose(work, rows, keys, race)

    logprobs: list[TopLogprobs | None] = [None] * n
    if wants:
        logprobs = compute_logprobs(
            logits, tokens, [k if k >= 0 else None for k in rows.logprobs.tolist()]
        )
    return SamplerOutput(tokens.tolist(), logprobs)


def sample_greedy(
    logits: torch.Tensor, argmax: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> SamplerOutput:
    """The hot path, for rows that are all plain greedy (SamplingParams.is_plain_greedy) and
    unconstrained: each row's argmax, no copy, no processing, no logprobs."""
    tokens = logits.argmax(dim=-1) if argmax is None else argmax(logits)
    return SamplerOutput(tokens.tolist(), [None] * logits.shape[0])


def _needs_processing(p: SamplingParams) -> bool:
    return bool(
        p.logit_bias
        or p.min_tokens
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )


def _choose(
    work: torch.Tensor,
    rows: RowParams,
    keys: torch.Tensor,
    race: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    if rows.greedy.all():
        return work.argmax(dim=-1)
    tokens = torch.empty(work.shape[0], dtype=torch.long, device=work.device)
    greedy_rows = np.flatnonzero(rows.greedy)
    if len(greedy_rows):
        index = torch.from_numpy(greedy_rows).to(work.device)
        tokens[index] = work.index_select(0, index).argmax(dim=-1)
    random_rows = np.flatnonzero(~rows.greedy)
    index = torch.from_numpy(random_rows).to(work.device)
    sub = work.index_select(0, index)  # a copy: filtering below never touches ``work``
    apply_filters(sub, rows.take(random_rows))
    tokens[index] = race(sub.softmax(dim=-1), keys.index_select(0, index.cpu()))
    return tokens


# -- step 0: structured outputs ------------------------------------------------------------------


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """Set the logits of the tokens the mask does not allow to -inf, in place, in its rows."""
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=mask.rows)
    return logits


# -- step 1-4: biases and penalties (greedy and sampled rows alike) ------------------------------


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """Apply logit_bias, min_tokens, repetition, presence and frequency penalties in place, in
    the rows `penalties` covers."""
    rows_of = penalties.rows
    chosen = dict(zip(rows_of, penalties.params, strict=True))
    prompt_ids = dict(zip(rows_of, penalties.prompt_ids, strict=True))
    output_ids = dict(zip(rows_of, penalties.output_ids, strict=True))
    eos_ids = dict(zip(rows_of, penalties.eos_ids, strict=True))
    rows, cols, vals = [], [], []
    for i, p in chosen.items():
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            vals.append(bias)
    if rows:
        _index_add(logits, rows, cols, vals)

    rows, cols = [], []
    for i, p in chosen.items():
        if len(output_ids[i]) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids[i]))
            rows.extend([i] * len(banned))
            cols.extend(banned)
    if rows:
        logits[_long(rows, logits), _long(cols, logits)] = _NEG_INF

    rep = [i for i, p in chosen.items() if p.repetition_penalty != 1.0]
    if rep:
        seen = _token_mask(logits, [list(prompt_ids[i]) + list(output_ids[i]) for i in rep])
        penalty = _column([chosen[i].repetition_penalty for i in rep], logits)
        sub = logits[_long(rep, logits)]
        penalised = torch.where(sub < 0, sub * penalty, sub / penalty)
        logits[_long(rep, logits)] = torch.where(seen, penalised, sub)

    pf = [i for i, p in chosen.items() if p.presence_penalty or p.frequency_penalty]
    if pf:
        counts = _token_counts(logits, [output_ids[i] for i in pf])
        presence = _column([chosen[i].presence_penalty for i in pf], logits)
        frequency = _column([chosen[i].frequency_penalty for i in pf], logits)
        index = _long(pf, logits)
        logits[index] -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def _long(values: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _index_add(logits: torch.Tensor, rows: list[int], cols: list[int], vals: list[float]) -> None:
    values = torch.tensor(vals, dtype=logits.dtype, device=logits.device)
    logits.index_put_((_long(rows, logits), _long(cols, logits)), values, accumulate=True)


def _flat_index(token_lists: Sequence[Sequence[int]], like: torch.Tensor):
    rows = [r for r, tokens in enumerate(token_lists) for _ in range(len(tokens))]
    cols = [t for tokens in token_lists for t in tokens]
    return _long(rows, like), _long(cols, like)


def _token_mask(like: torch.Tensor, token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """[R, V] bool: which tokens occur in each row's list."""
    mask = torch.zeros(len(token_lists), like.shape[1], dtype=torch.bool, device=like.device)
    mask[_flat_index(token_lists, like)] = True
    return mask


def _token_counts(like: torch.Tensor, token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
    """[R, V] float: how often each token occurs in each row's list."""
    counts = torch.zeros(len(token_lists), like.shape[1], dtype=like.dtype, device=like.device)
    rows, cols = _flat_index(token_lists, like)
    counts.index_put_((rows, cols), torch.ones_like(rows, dtype=like.dtype), accumulate=True)
    return counts


# -- step 5: temperature and truncation (sampled rows only) --------------------------------------


def apply_filters(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """Apply temperature, top_k, top_p and min_p in place (HF's warper order); -inf = removed.

    Rows must not be greedy (temperature > 0).
    """
    temps = rows.temperature
    if (temps == temps[0]).all():
        if temps[0] != 1.0:
            logits.div_(float(temps[0]))
    else:
        logits.div_(_as_column(temps, logits))

    vocab = logits.shape[1]
    top_k = np.where((rows.top_k > 0) & (rows.top_k < vocab), rows.top_k, vocab)
    if (top_k < vocab).any():
        _top_k(logits, top_k)
    if (rows.top_p < 1.0).any():
        _top_p(logits, rows.top_p)

    if rows.min_p.any():
        probs = logits.softmax(dim=-1)
        threshold = _as_column(rows.min_p, logits) * probs.amax(dim=-1, keepdim=True)
        logits.masked_fill_(probs < threshold, _NEG_INF)  # the top token always survives
    return logits


def _as_column(values: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(values).to(like.device, like.dtype).unsqueeze(1)


def _top_k(logits: torch.Tensor, top_k: np.ndarray) -> None:
    # Without top_p a partial topk is enough; ties with the k-th value survive, as in HF.
    k = torch.from_numpy(top_k).to(logits.device).unsqueeze(1)
    values = logits.topk(int(top_k.max()), dim=-1).values
    logits.masked_fill_(logits < values.gather(1, k - 1), _NEG_INF)


def _top_p(logits: torch.Tensor, top_p: np.ndarray) -> None:
    # Only the tokens top_k left can survive: sort those (the most any row kept), not the whole
    # vocabulary. The -inf ones ahead of them add nothing to the cumulative sums.
    vocab = logits.shape[1]
    kept = int(torch.isfinite(logits).sum(dim=-1).max())
    if kept < vocab:
        values, index = logits.topk(kept, dim=-1)  # descending
        ordered, order = values.flip(-1), index.flip(-1)
    else:
        ordered, order = logits.sort(dim=-1)  # ascending
    # Drop the least likely tokens while their total mass stays within 1 - top_p; the token that
    # crosses the threshold is kept, and so is the most likely one.
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - _as_column(top_p, logits)
    drop[:, -1] = False
    ordered.masked_fill_(drop, _NEG_INF)
    logits.scatter_(1, order, ordered)


# -- logprobs -------------------------------------------------------------------------------------


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int | None]
) -> list[TopLogprobs | None]:
    """Logprobs of ``token_ids[i]`` under log_softmax(logits[i]) plus the top ``num_top[i]``.

    Rows with ``num_top[i] is None`` get None. Also serves prompt logprobs: pass the logits of
    the prompt positions and the prompt's next tokens.
    """
    rows = [i for i, k in enumerate(num_top) if k is not None]
    result: list[TopLogprobs | None] = [None] * len(num_top)
    if not rows:
        return result
    index = _long(rows, logits)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)
    chosen = token_ids.to(logits.device)[index].unsqueeze(1)
    chosen_logprob = logprobs.gather(1, chosen)
    ranks = (logprobs > chosen_logprob).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(max(num_top[i] for i in rows), dim=-1)
    # One host transfer per tensor rather than one per element.
    columns = zip(
        chosen.squeeze(1).tolist(),
        chosen_logprob.squeeze(1).tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_values.tolist(),
        strict=True,
    )
    for i, (token, logprob, rank, ids, values) in zip(rows, columns, strict=True):
        k = num_top[i]
        result[i] = TopLogprobs(token, logprob, rank, ids[:k], values[:k])
    return result
