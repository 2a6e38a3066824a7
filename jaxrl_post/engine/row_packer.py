"""The one row packer: items of given lengths placed whole into rows of `row_len` tokens (host, numpy, pure).

Every packed layout of the package places its items here, longest first (ties: the lower index first):

* the RL mini-batch (`packing.plan_packing`): sequences into `n_micro * rows` rows, first fit, with two group
  limits (sequence slots per micro-batch, response slots per slot block);
* SFT examples per step (`sft_step.layout_batch`) and DPO pairs per step (`dpo_step.layout_pairs`), first fit;
* a whole SFT or DPO training set once (`data.packing_strategy='bfd'`, `SFTTask.pack_dataset`,
  `DPOTask.pack_dataset`), best fit.

Strategies: ``"ffd"`` (first-fit decreasing: the lowest-numbered open row with room, else the lowest-numbered
unopened row its group limits allow) and ``"bfd"`` (best-fit decreasing: the open row with the least room that
still fits the item; equal room: the row that reached that room first; a new row when none fits). Rows are never
split and items never reordered inside a row: an item's offset is the tokens placed in its row before it.

Sources: TRL `pack_dataset(strategy="bfd")` (best fit decreasing over a dataset), grain's first-fit packing
(`FirstFitPackIterDataset`), verl `use_dynamic_bsz` (token-budget micro-batches).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

STRATEGIES = ("ffd", "bfd")


@dataclasses.dataclass(frozen=True)
class GroupLimit:
    """At most `cap` of a per-item weight in each group of `rows` consecutive rows (rows `[g * rows, (g + 1) *
    rows)` form group g). `weights [N]` (int): each item's weight; None: 1 per item (at most `cap` items)."""

    rows: int
    cap: int
    weights: Sequence[int] | np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Where `pack_rows` put each of N items.

    row: `[N] int64`, the item's row (-1: an empty item left out by `skip_empty`); offset: `[N] int64`, its first
    token in the row; order: `[P] int64`, the placed items in the order they were placed (longest first);
    starts: per `GroupLimit`, `[N] int64`, the weight its group held before the item joined (with weights 1: the
    item's index among its group's items); n_rows: the rows of the plan (`max_rows` when given, else the rows
    opened).
    """

    row: np.ndarray
    offset: np.ndarray
    order: np.ndarray
    starts: tuple[np.ndarray, ...]
    n_rows: int

    def rows(self) -> list[list[int]]:
        """The items of each row `0 .. n_rows - 1` in placement order (= offset order); unopened rows are []."""
        out: list[list[int]] = [[] for _ in range(self.n_rows)]
        for i in self.order.tolist():
            out[self.row[i]].append(i)
        return out


def pack_rows(
    lengths: Sequence[int] | np.ndarray,
    row_len: int,
    *,
    strategy: str = "ffd",
    max_rows: int | None = None,
    limits: Sequence[GroupLimit] = (),
    skip_empty: bool = False,
) -> RowPlan:
    """Place items of `lengths [N]` (int, tokens) whole into rows of `row_len` tokens (module docstring).

    Args:
      lengths: tokens of each item.
      row_len: tokens per row.
      strategy: ``"ffd"`` (first fit) or ``"bfd"`` (best fit), both longest first.
      max_rows: the rows there are (None: as many as needed, at most N).
      limits: `GroupLimit`s every row's group must keep (``"ffd"`` with `max_rows` only).
      skip_empty: leave items of length 0 out (row -1); otherwise they are placed like any other item.
    Returns:
      `RowPlan` (pure function of the arguments).
    Raises:
      ValueError: an unknown strategy, a negative length, an item longer than `row_len`, limits without
        ``"ffd"`` and `max_rows` or with rows < 1 or weights of another length, or the items do not fit
        `max_rows` rows and the limits.
    """
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    n = len(lengths)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: must be one of {list(STRATEGIES)}")
    if n and lengths.min() < 0:
        raise ValueError(f"negative length {int(lengths.min())}")
    if n and lengths.max() > row_len:
        raise ValueError(f"an item of {int(lengths.max())} tokens does not fit a row of {row_len}")
    if limits and (strategy != "ffd" or max_rows is None):
        raise ValueError(
            "group limits need max_rows" if strategy == "ffd" else "group limits need strategy='ffd' and max_rows"
        )
    weights = [np.ones(n, np.int64) if g.weights is None else np.asarray(g.weights, np.int64) for g in limits]
    for g, w in zip(limits, weights, strict=True):
        if w.shape != (n,) or int(g.rows) < 1:
            raise ValueError(f"{g}: needs rows >= 1 and weights of the {n} items (got {w.size})")
    index = np.arange(n)
    keep = index[lengths > 0] if skip_empty else index
    order = keep[np.lexsort((keep, -lengths[keep]))]  # longest first, ties: lower index first
    row, offset = [-1] * n, [0] * n  # python ints in the loops: numpy scalars cost more than the search
    starts = [[0] * n for _ in limits]
    sizes = lengths.tolist()
    if strategy == "bfd":
        n_rows = _best_fit(sizes, order.tolist(), row_len, max_rows, row, offset)
    else:
        n_rows = _first_fit(sizes, order.tolist(), row_len, max_rows, limits, weights, row, offset, starts)
    return RowPlan(
        row=np.asarray(row, np.int64),
        offset=np.asarray(offset, np.int64),
        order=order,
        starts=tuple(np.asarray(x, np.int64) for x in starts),
        n_rows=n_rows,
    )


def _no_room(n_items: int, max_rows: int | None, row_len: int, limits) -> ValueError:
    why = " and their group limits" if limits else ""
    return ValueError(f"{n_items} items do not fit {max_rows} rows of {row_len} tokens{why}")


def _first_fit(sizes, order, row_len, max_rows, limits, weights, row, offset, starts) -> int:
    """First fit over a fixed grid of rows (`max_rows`, else one per item); fills `row`, `offset`, `starts`.
    Without limits every unopened row is allowed, so the open rows are always rows `0 .. n_open - 1`."""
    grid = len(order) if max_rows is None else int(max_rows)
    used = np.zeros(grid, np.int64)
    opened = np.zeros(grid, bool)
    n_open = 0
    caps = [int(g.cap) for g in limits]
    group_of = [np.arange(grid) // int(g.rows) for g in limits]
    held = [np.zeros(-(-grid // int(g.rows)), np.int64) for g in limits]
    wl = [w.tolist() for w in weights]
    for i in order:
        need = sizes[i]
        if limits:
            allowed = held[0][group_of[0]] <= caps[0] - wl[0][i]
            for k in range(1, len(limits)):
                allowed &= held[k][group_of[k]] <= caps[k] - wl[k][i]
            fits = opened & (used <= row_len - need) & allowed
            r = int(fits.argmax())
            if not fits[r]:
                fits = ~opened & allowed
                r = int(fits.argmax())
                if not fits[r]:
                    raise _no_room(len(order), max_rows, row_len, limits)
        else:
            fits = used[:n_open] <= row_len - need
            r = int(fits.argmax()) if n_open else 0
            if not n_open or not fits[r]:
                if n_open == grid:
                    raise _no_room(len(order), max_rows, row_len, limits)
                r = n_open
        row[i], offset[i] = r, int(used[r])
        for k in range(len(limits)):
            g = int(group_of[k][r])
            starts[k][i] = int(held[k][g])
            held[k][g] += wl[k][i]
        n_open += not opened[r]
        opened[r] = True
        used[r] += need
    return grid if max_rows is not None else n_open


def _best_fit(sizes, order, row_len, max_rows, row, offset) -> int:
    """Best fit: the open rows' free tokens kept sorted (`frees`, ascending; `owners[k]` is the row of `frees[k]`;
    a row re-enters after the rows of equal room, so equal room goes to the row that reached it first); fills
    `row` and `offset`."""
    frees: list[int] = []
    owners: list[int] = []
    n_rows = 0
    for i in order:
        need = sizes[i]
        k = bisect.bisect_left(frees, need)
        if k == len(frees):
            if max_rows is not None and n_rows == max_rows:
                raise _no_room(len(order), max_rows, row_len, ())
            r, free = n_rows, row_len
            n_rows += 1
        else:
            r, free = owners.pop(k), frees.pop(k)
        row[i], offset[i] = r, row_len - free
        k = bisect.bisect_right(frees, free - need)
        frees.insert(k, free - need)
        owners.insert(k, r)
    return n_rows if max_rows is None else int(max_rows)
