"""Static, preallocated KV cache with per-row committed lengths.

Layout: ``k, v`` are ``[L, B_max, H_kv, S_max, D]``. Row ``r`` holds one sequence; its first
``lengths[r]`` slots are *committed* (tokens accepted into the sequence). A forward pass writes
its T new tokens at slots ``lengths[r] .. lengths[r]+T-1`` (the scratch area); nothing is
committed until :meth:`commit` picks which of those slots stay (an accepted tree path), moving them
to be contiguous. Rejected slots are simply overwritten by the next write — nothing is rolled back.

Lengths are kept on the host (Python ints): the engine needs them for shapes every step anyway,
and keeping them host-side avoids a device sync per step.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, max_batch: int, num_kv_heads: int, max_seq_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_layers, max_batch, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # [L, B_max, H_kv, S_max, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)   # [L, B_max, H_kv, S_max, D]
        self.lengths: list[int] = [0] * max_batch
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self._write_rows: slice = slice(0, 0)
        self._write_starts: list[int] = []
        self._write_T = 0
        self._index: tuple[torch.Tensor, ...] | None = None

    @property
    def device(self) -> torch.device:
        return self.k.device

    # ---- writing (called by the model, once per layer) -------------------------------------
    def begin_write(self, rows: slice, num_new: int, starts: list[int] | None = None) -> int:
        """Prepare a forward over rows ``rows`` writing ``num_new`` tokens per row.

        ``starts`` defaults to each row's committed length. Returns S_used, the number of key
        slots the attention must cover (max over rows of start + num_new).
        """
        starts = list(self.lengths[rows]) if starts is None else list(starts)
        B = rows.stop - rows.start
        if len(starts) != B:
            raise ValueError(f"starts has {len(starts)} entries for {B} rows")
        s_used = max(starts) + num_new
        if s_used > self.max_seq_len:
            raise ValueError(f"KV cache overflow: need {s_used} slots, max_seq_len is "
                             f"{self.max_seq_len}")
        self._write_rows, self._write_starts, self._write_T = rows, starts, num_new
        if all(s == starts[0] for s in starts):
            self._index = None  # contiguous block: plain slice assignment
        else:
            dev = self.device
            H = self.k.shape[2]
            new = torch.arange(num_new, device=dev)
            slots = torch.tensor(starts, device=dev)[:, None] + new                      # [B, T]
            b_idx = torch.arange(rows.start, rows.stop, device=dev)[:, None, None]       # [B, 1, 1]
            h_idx = torch.arange(H, device=dev)[None, :, None]                           # [1, H, 1]
            self._index = (b_idx, h_idx, slots[:, None, :])
        return s_used

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              s_used: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ``[B, H_kv, T, D]`` for ``layer``; return the rows' keys/values
        ``[B, H_kv, S_used, D]``."""
        rows = self._write_rows
        kc, vc = self.k[layer], self.v[layer]                         # [B_max, H_kv, S_max, D]
        if self._index is None:
            s0 = self._write_starts[0]
            kc[rows, :, s0:s0 + self._write_T] = k
            vc[rows, :, s0:s0 + self._write_T] = v
        else:
            kc.index_put_(self._index, k)
            vc.index_put_(self._index, v)
        return kc[rows, :, :s_used], vc[rows, :, :s_used]

    # ---- committing ------------------------------------------------------------------------
    def commit(self, rows: slice, path: torch.Tensor, num: list[int]) -> None:
        """Keep, for each row, the just-written slots ``path[b, :num[b]]`` (offsets from the row's
        committed length, increasing) as the next ``num[b]`` committed tokens.

        path: [B, A] int64 (padded; entries past num[b] ignored). Offsets must satisfy
        ``path[b, i] >= i`` (true for topologically ordered trees), so a gather-then-scatter is
        safe.
        """
        B = rows.stop - rows.start
        if len(num) != B or path.shape[0] != B:
            raise ValueError("commit: path/num do not match the rows")
        path_cpu = path.tolist()
        for i in range(B):
            r = rows.start + i
            n = num[i]
            base = self.lengths[r]
            if n <= 0:
                continue
            offs = path_cpu[i][:n]
            if offs != list(range(n)):  # contiguous prefix needs no copy
                if any(o < j for j, o in enumerate(offs)):
                    raise ValueError(f"commit: path offsets {offs} must satisfy path[i] >= i")
                src = torch.tensor(offs, device=self.device) + base
                dst = slice(base, base + n)
                self.k[:, r, :, dst] = self.k[:, r, :, src]
                self.v[:, r, :, dst] = self.v[:, r, :, src]
            if base + n > self.max_seq_len:
                raise ValueError("commit past max_seq_len")
            self.lengths[r] = base + n

    def commit_all(self, rows: slice, num: list[int]) -> None:
        """Commit the first ``num[b]`` written slots of each row as they are (prefill / chains)."""
        for i, n in enumerate(num):
            self.lengths[rows.start + i] += n

    # ---- row management (continuous batching) -------------------------------------------------
    def reset_row(self, r: int) -> None:
        self.lengths[r] = 0

    def move_row(self, src: int, dst: int) -> None:
        """Move row ``src``'s committed content to row ``dst`` (compaction when a request
        leaves)."""
        n = self.lengths[src]
        if n:
            self.k[:, dst, :, :n] = self.k[:, src, :, :n]
            self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0
