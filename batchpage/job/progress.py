"""The job's progress bar: it moves on tokens, not only rows, so it is alive from the first step.

The bar counts token work: every row costs its prompt tokens plus its largest possible output
(n * max_tokens, or what is left of max_model_len). The bar advances by the tokens the engine
handles (prompt tokens computed or served by the prefix cache, tokens generated) and its total
shrinks when a row stops early, by the output budget it did not use. tqdm's ETA, (total - done)
over the measured rate, is then an upper bound that is sane from the first steps. Rows not yet
read are costed at the average of those read so far.

Messages (stages, resume notes) go through `note`, which prints above the bar without breaking it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from batchpage.metrics import RunStats, tokens_per_s


@dataclass
class TokenWork:
    """The arithmetic behind the bar, kept apart from tqdm so it can be tested."""

    rows_total: int | None  # None: unknown until the input is read to its end
    rows_known: int = 0  # rows whose cost has been added
    cost_known: int = 0  # their prompt tokens plus output budgets, less budgets released
    done: int = 0  # tokens handled

    def add_rows(self, costs: list[int]) -> None:
        self.rows_known += len(costs)
        self.cost_known += sum(costs)

    def release(self, unused_budget: int) -> None:
        """A row stopped before its output budget ran out: that work will never be done."""
        self.cost_known -= unused_budget

    def advance(self, tokens: int) -> None:
        self.done += tokens

    @property
    def total(self) -> int:
        """Known costs, plus the rows not read yet at the average cost so far."""
        unread = max(0, (self.rows_total or self.rows_known) - self.rows_known)
        average = self.cost_known / self.rows_known if self.rows_known else 0.0
        return max(self.done, round(self.cost_known + unread * average))

    def eta_s(self, rate: float) -> float | None:
        """Seconds left at `rate` tokens/s; None before anything was measured."""
        return (self.total - self.done) / rate if rate > 0 else None


class JobProgress:
    """One bar for the whole job (rows done are shown beside it)."""

    def __init__(self, rows_total: int | None, enabled: bool) -> None:
        self.work = TokenWork(rows_total)
        self.rows_total = rows_total
        self.rows_done = 0
        self.rows_failed = 0  # of rows_done: rows whose result is an error
        self._started = time.monotonic()
        self._out_tok_s: float | None = None
        self.bar = tqdm(
            total=0,
            unit="tok",
            unit_scale=True,
            desc="tokens",
            disable=not enabled,
            dynamic_ncols=True,
        )
        self._drawn = float("-inf")  # when the bar was last drawn (time.monotonic)
        self._window_base = 0  # tokens handled before the current window's run
        self._stage = "starting"
        # An executor's replicas in a few words (ReplicaPool.replica_line), shown beside the
        # rows; None for the local engine.
        self.replicas: Callable[[], str] | None = None
        # The seconds left by the job's estimate (JobEstimate.eta_s; None from it: not yet);
        # None: the job has no estimate, the ETA is the token work left at the rate so far.
        self.eta_model: Callable[[], float | None] | None = None

    def note(self, message: str) -> None:
        tqdm.write(message, file=sys.stderr)  # above the bar; plain stderr when there is none

    def stage(self, name: str) -> None:
        self._stage = name
        self._refresh(force=True)

    def rows_skipped(self, count: int, failed: bool = False) -> None:
        """Rows that need no generation (resumed, or `failed` before generating)."""
        self.rows_done += count
        self.rows_failed += count if failed else 0
        if self.work.rows_total is not None:
            self.work.rows_total -= count
        self._refresh()

    def window_started(self, costs: list[int]) -> None:
        self.work.add_rows(costs)
        self._window_base = self.work.done
        self._refresh()

    def step(self, stats: RunStats, tok_s: float) -> None:
        """After each engine step: `stats` is the running window's, `tok_s` the job's rate."""
        handled = stats.prefill_tokens_computed + stats.cached_prompt_tokens
        self.work.done = self._window_base + handled + stats.generated_tokens
        self._stage = "generating" if stats.generated_tokens else "prefill"
        self._out_tok_s = tok_s
        self._refresh(tok_s)

    def row_finished(self, unused_budget: int, failed: bool = False) -> None:
        self.rows_done += 1
        self.rows_failed += failed
        self.work.release(unused_budget)
        self._refresh()

    def close(self) -> None:
        self.bar.close()

    def snapshot(self) -> dict[str, Any]:
        """The bar's figures as data: rows, the stage, the job's output rate and the seconds
        left: by the job's estimate (`eta_from` "estimate"), or where it has none at the rate
        the bar's token work has gone so far ("rate"; None before any)."""
        elapsed = time.monotonic() - self._started
        eta = self.eta_model() if self.eta_model is not None else None
        basis = "estimate"
        if eta is None:
            eta = self.work.eta_s(self.work.done / elapsed if elapsed > 0 else 0.0)
            basis = "rate"
        return {
            "stage": self._stage,
            "rows_total": self.rows_total,
            "rows_done": self.rows_done,
            "rows_failed": self.rows_failed,
            "out_tok_s": self._out_tok_s,
            "elapsed_s": round(elapsed, 1),
            "eta_s": None if eta is None else round(eta, 1),
            "eta_from": basis,
        }

    def _refresh(self, tok_s: float | None = None, force: bool = False) -> None:
        """The bar's figures and text now; drawn at most every `mininterval` seconds (tqdm's)
        unless `force`d: a job of short rows calls this for every row and step, and a redraw
        costs more than the row's own bookkeeping. close() draws the last state."""
        self.bar.total = self.work.total
        self.bar.n = min(self.work.done, self.bar.total)
        rows = f"{self.rows_done}/{self.rows_total}" if self.rows_total is not None else "?"
        fields = [f"rows={rows}", f"stage={self._stage}"]
        if tok_s is not None:
            fields.append(f"out_tok_s={tok_s:.1f}")
        if self.replicas is not None:
            fields.append(f"replicas={self.replicas().strip()}")
        # What tqdm's set_postfix makes of these string fields, without its per-call dict work.
        self.bar.postfix = ", ".join(fields)
        if self.bar.disable:
            return
        now = time.monotonic()
        if force or now - self._drawn >= self.bar.mininterval:
            self._drawn = now
            self.bar.refresh()


def job_rate(before: RunStats, current: RunStats) -> float:
    """The one throughput figure: generated tokens over the time spent generating."""
    return tokens_per_s(
        before.generated_tokens + current.generated_tokens, before.elapsed_s + current.elapsed_s
    )
