"""Every live MEPIC sequence's token map in pooled arrays, one row per sequence.

Why: the runner places every sequence of every step. Reading maps one by one costs Python work
per sequence, and extending a map's tables for decode tokens grows with decode length. A pool
row holds a map's per-token tables and its table-entry tables for the whole block-table width
(past the layout, decode continues by formula), so a step is a few gathers over the batch's rows
whatever its size. Rows are keyed by request id, not by vLLM's batch row, so vLLM moving rows
(condense, swaps) needs nothing here. Row ``PLAIN_ROW`` is the identity map of sequences without
one (index = position, every entry real from slot 0): plain sequences are gathered with the
rest.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from ascend_mepic.worker.token_map import TokenMap

PLAIN_ROW = 0


class TokenMapPool:
    """Token maps of the live sequences, by request id, in rows of preallocated arrays."""

    def __init__(self, block_size: int, rows: int = 64) -> None:
        self.block_size = block_size
        self._row_of: dict[str, int] = {}
        self._free: list[int] = []
        self._next_row = PLAIN_ROW + 1
        self.num_in_context = np.zeros(rows, dtype=np.int64)
        self.padded_len = np.zeros(rows, dtype=np.int64)
        self.real_len = np.zeros(rows, dtype=np.int64)
        self.blend_ratio = np.zeros(rows, dtype=np.float64)
        self.blends = np.zeros(rows, dtype=bool)
        self.decodes = np.ones(rows, dtype=bool)  # False for chunk compiles (never decode)
        # [rows, in-context tokens]
        self.token_padded = np.zeros((rows, 1), dtype=np.int32)
        self.token_position = np.zeros((rows, 1), dtype=np.int32)
        self.token_in_chunk = np.zeros((rows, 1), dtype=bool)
        # [rows, table entries]
        self.first_pos = np.zeros((rows, 0), dtype=np.int32)
        self.valid_start = np.zeros((rows, 0), dtype=np.int32)
        self.valid_end = np.zeros((rows, 0), dtype=np.int32)
        self._live = np.ones((1, 0), dtype=np.int32)  # [k, entries]: 1 for entries below k

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._row_of

    def __len__(self) -> int:
        return len(self._row_of)

    def add(
        self,
        req_id: str,
        tmap: TokenMap,
        blend_ratio: float | None = None,
        decodes: bool = True,
    ) -> None:
        """Take a sequence's map (a resumed sequence's new map replaces its old one);
        ``decodes`` is False for a chunk compile, whose tokens end with the chunk."""
        if tmap.block_size != self.block_size:
            raise ValueError(f"a block-{tmap.block_size} map in a block-{self.block_size} pool")
        row = self._row_of.get(req_id)
        if row is None:
            row = self._take_row()
            self._row_of[req_id] = row
        n = tmap.num_in_context
        self._grow_tokens(n)
        self._grow_entries(len(tmap.first_pos))
        self.num_in_context[row] = n
        self.padded_len[row] = tmap.padded_len
        self.real_len[row] = tmap.real_len
        self.blends[row] = blend_ratio is not None
        self.blend_ratio[row] = blend_ratio or 0.0
        self.decodes[row] = decodes
        self.token_padded[row, :n] = tmap.padded
        self.token_position[row, :n] = tmap.position
        self.token_in_chunk[row, :n] = tmap.in_chunk
        k = len(tmap.first_pos)
        self.first_pos[row, :k] = tmap.first_pos
        self.valid_start[row, :k] = tmap.valid_start
        self.valid_end[row, :k] = tmap.valid_end
        self._continue_entries(np.array([row]), k)

    def remove(self, req_id: str) -> None:
        row = self._row_of.pop(req_id, None)
        if row is not None:
            self._free.append(row)

    def rows(self, req_ids: list[str]) -> np.ndarray:
        """Pool row of each request (``PLAIN_ROW`` for those without a map); the lookups run in
        C (``map`` over ``dict.get``), not one Python statement per request."""
        get = self._row_of.get
        return np.fromiter(map(get, req_ids, repeat(PLAIN_ROW)), dtype=np.intp, count=len(req_ids))

    def place(
        self, token_rows: np.ndarray, index: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Padded index and logical position of tokens number ``index`` of rows ``token_rows``:
        in-context tokens through the map, later (decode) tokens after the layout. Third: per
        token, whether it is a chunk token of a CacheBlend sequence (None when no sequence of
        the step blends)."""
        n = self.num_in_context[token_rows]
        inside = index < n
        clipped = np.minimum(index, np.maximum(n - 1, 0))
        extra = index - n
        padded = np.where(
            inside, self.token_padded[token_rows, clipped], self.padded_len[token_rows] + extra
        )
        position = np.where(
            inside, self.token_position[token_rows, clipped], self.real_len[token_rows] + extra
        )
        candidate = None
        blends = self.blends[token_rows]
        if blends.any():
            candidate = blends & inside & self.token_in_chunk[token_rows, clipped]
        return padded, position, candidate

    def entries(
        self, rows: np.ndarray, num_blocks: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The first ``num_blocks[i]`` table entries of ``rows[i]``, zero-padded ``[R, width]``
        arrays: first position, valid start, valid end."""
        width = max(1, int(num_blocks.max())) if len(num_blocks) else 1
        self._grow_entries(width)
        live = self._live[num_blocks, :width]  # [R, width] 1 where the entry is listed

        def gather(table: np.ndarray) -> np.ndarray:
            out = table[:, :width].take(rows, axis=0)
            out *= live
            return out

        return gather(self.first_pos), gather(self.valid_start), gather(self.valid_end)

    def _take_row(self) -> int:
        if self._free:
            return self._free.pop()
        row = self._next_row
        self._next_row += 1
        if row >= len(self.num_in_context):
            self._grow_rows(2 * len(self.num_in_context))
        return row

    def _grow_rows(self, rows: int) -> None:
        for name in (
            "num_in_context",
            "padded_len",
            "real_len",
            "blend_ratio",
            "blends",
            "decodes",
            "token_padded",
            "token_position",
            "token_in_chunk",
            "first_pos",
            "valid_start",
            "valid_end",
        ):
            old = getattr(self, name)
            new = np.zeros((rows, *old.shape[1:]), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _widen(self, names: tuple[str, ...], width: int) -> None:
        """Give the named tables ``width`` columns, keeping their contents."""
        for name in names:
            table = getattr(self, name)
            grown = np.zeros((len(table), width), dtype=table.dtype)
            grown[:, : table.shape[1]] = table
            setattr(self, name, grown)

    def _grow_tokens(self, width: int) -> None:
        old = self.token_padded.shape[1]
        if width <= old:
            return
        self._widen(("token_padded", "token_position", "token_in_chunk"), max(width, 2 * old))

    def _grow_entries(self, width: int) -> None:
        """Widen the entry tables; every row's new entries are past its layout (decode)."""
        old = self.first_pos.shape[1]
        if width <= old:
            return
        width = max(width, 2 * old)
        self._widen(("first_pos", "valid_start", "valid_end"), width)
        self._continue_entries(np.arange(len(self.first_pos)), old)
        self._live = np.tri(width + 1, width, -1, dtype=np.int32)

    def _continue_entries(self, rows: np.ndarray, start: int) -> None:
        """Entries from ``start`` on of ``rows``: past the layout, decode fills whole blocks
        whose first position follows the real tokens as the padded index follows the layout."""
        j = np.arange(start, self.first_pos.shape[1], dtype=np.int64)
        first = self.real_len[rows, None] + j * self.block_size - self.padded_len[rows, None]
        self.first_pos[rows[:, None], j] = first
        self.valid_start[rows[:, None], j] = 0
        self.valid_end[rows[:, None], j] = self.block_size
