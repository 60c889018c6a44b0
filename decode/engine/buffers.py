"""Preallocated key/value buffers (``SlotBuffers``) that ``decode.engine.cache.KVState`` decodes into and
recorded steps (``decode.engine.compiled``, the fused forward of ``decode.engine.lean``) write in place."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, StaticLayer


class SlotLayer(StaticLayer):
    """One layer's preallocated keys and values [B, H, capacity, D].

    Eager forwards write at ``end`` (a Python int the state sets before each forward) and get back the
    filled slots only, so attention costs what the text holds, not the capacity. Compiled steps
    (``end`` None) take transformers' static path: the write offset is a tensor and the whole buffer is
    returned, shapes fixed; the mask hides what is not a slot of the row.

    zeroed: the buffers start as zeros, which a state whose steps run compiled needs (a masked slot
    still enters the product, and uninitialised memory may hold NaN). An eager state's buffers start
    uninitialised: it reads only slots it wrote (or zeroed, as alignment holes), so allocating costs
    nothing."""

    def __init__(self, capacity: int, device: torch.device, zeroed: bool = True):
        super().__init__(capacity)
        # on the buffers' device from the start, so the layer's initialisation keeps this tensor
        self.cumulative_length = torch.zeros((), dtype=torch.long, device=device)
        self.end: int | None = 0
        self.offset = 0  # the first slot in use: slots before it are dead (no row of the batch keeps them)
        self.zeroed = zeroed

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers for as many rows as ``key_states`` has: the row capacity (``use_rows`` views fewer)."""
        if self.zeroed:
            super().lazy_initialization(key_states, value_states)
        else:
            self.dtype, self.device = key_states.dtype, key_states.device
            self.batch_size, self.num_heads = key_states.shape[:2]
            self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
            shape = (self.batch_size, self.num_heads, self.max_cache_len)
            self.keys = torch.empty(*shape, self.k_head_dim, dtype=self.dtype, device=self.device)
            self.values = torch.empty(*shape, self.v_head_dim, dtype=self.dtype, device=self.device)
            self.is_initialized = True
        self.store = (self.keys, self.values)

    def use_rows(self, n: int) -> None:
        """The layer's keys and values become the first ``n`` rows of its buffers."""
        keys, values = self.store
        if self.keys.shape[0] == n:
            return
        self.keys, self.values = keys[:n], values[:n]
        if self.zeroed and not torch.compiler.is_compiling():  # compiled steps: the views keep a static address
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.end is None:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.end
        self.end += key_states.shape[-2]
        self.keys[:, :, start : self.end] = key_states
        self.values[:, :, start : self.end] = value_states
        return self.keys[:, :, self.offset : self.end], self.values[:, :, self.offset : self.end]

    def get_seq_length(self) -> int:
        return self.end - self.offset if self.end is not None else super().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.end is None:
            return super().get_mask_sizes(query_length)
        return self.end - self.offset + query_length, 0


class SlotBuffers(Cache):
    """Every layer's ``SlotLayer`` of one capacity. Slots past what the slot book committed hold stale
    values that every mask hides, so dropping a tail is only bookkeeping: each forward starts by
    setting the write offsets to the committed length (``at``). Slot i of the slot book is slot
    ``offset + i`` of the buffers: dropping dead slots at the head is bookkeeping too (``drop_head``)."""

    def __init__(self, num_layers: int, capacity: int, device: torch.device, zeroed: bool = True):
        super().__init__(layers=[SlotLayer(capacity, device, zeroed) for _ in range(num_layers)])
        self.capacity = capacity

    def nbytes(self) -> int:
        """The bytes the buffers hold (allocated, every row's capacity, not only the filled slots)."""
        return sum(t.nbytes for layer in self.layers for t in (getattr(layer, "store", None) or ()))

    @classmethod
    def holding(cls, kv: list[tuple[torch.Tensor, torch.Tensor]], capacity: int, zeroed: bool = True, rows: int = 0) -> "SlotBuffers":
        """Buffers of ``capacity`` slots whose first slots hold ``kv`` (per layer keys, values [B, H, S, D])."""
        return cls.stacking([(kv, kv[0][0].shape[2])], kv[0][0].shape[2], capacity, zeroed, rows)

    @classmethod
    def stacking(cls, sides: list[tuple[list, int]], width: int, capacity: int, zeroed: bool = True, rows: int = 0) -> "SlotBuffers":
        """Buffers whose rows are the sides' rows in order, each side's ``length`` slots (its per layer
        keys, values [B_i, H, length, D], or [] for a side of empty rows, then given as its row count)
        right-aligned to ``width``; the holes on their left are zeros. One copy of each side. ``rows``:
        room for that many rows at least, so that rows admitted later are written in place."""
        ref = next(kv for kv, _ in sides if isinstance(kv, list) and kv)
        counts = [kv[0][0].shape[0] if isinstance(kv, list) else kv for kv, _ in sides]
        out = cls(len(ref), capacity, ref[0][0].device, zeroed)
        room = max(rows, sum(counts))
        for i, layer in enumerate(out.layers):
            k_like, v_like = ref[i]
            layer.lazy_initialization(k_like[:1, :, :1].expand(room, -1, -1, -1), v_like[:1, :, :1].expand(room, -1, -1, -1))
            layer.use_rows(sum(counts))
        row = 0
        for (kv, length), n in zip(sides, counts):
            out.write_rows(row, n, kv if length else None, length, width)
            row += n
        return out

    @property
    def offset(self) -> int:
        """The first buffer slot in use (every layer's)."""
        return self.layers[0].offset

    @property
    def rows(self) -> int:
        """The rows the buffers have room for."""
        return self.layers[0].store[0].shape[0]

    def write_rows(self, row: int, n: int, kv: list | None, length: int, width: int) -> None:
        """Rows row..row+n-1 hold ``kv``'s ``length`` slots (per layer keys, values [n, H, length, D];
        None: no slots) right-aligned to ``width``, holes on their left zeroed (a hole still enters an
        eager forward's product: it must hold a number)."""
        start, end = self.offset, self.offset + width
        for i, layer in enumerate(self.layers):
            for j, buf in enumerate(layer.store):
                part = buf[row : row + n]
                if not layer.zeroed:  # a compiled state's buffers start zeroed and hold numbers since
                    part[:, :, start : end - length].zero_()
                if length:
                    part[:, :, end - length : end] = kv[i][j]

    def admit_rows(self, kv: list | None, n: int, length: int, width: int) -> None:
        """``n`` rows after the ones in use, written in place (the buffers have room for them)."""
        row = self.layers[0].keys.shape[0]
        self.write_rows(row, n, kv, length, width)
        for layer in self.layers:
            layer.use_rows(row + n)

    def keep_rows(self, rows: torch.Tensor, length: int) -> None:
        """Only ``rows`` (indices of the rows in use, in their new order) stay, moved in place; their first
        ``length`` slots are what moves."""
        n = rows.shape[0]
        moved = (rows != torch.arange(n, device=rows.device)).nonzero()[:, 0]
        if moved.numel():
            # only the rows whose place changed (swap-removal moves one row per finished one); the
            # gather copies the sources before the scatter writes, so a row may move onto another's place
            source, slots = rows[moved], slice(self.offset, self.offset + length)
            for layer in self.layers:
                for buf in layer.store:
                    buf[moved, :, slots] = buf[source, :, slots]
        for layer in self.layers:
            layer.use_rows(n)

    def drop_head(self, n: int) -> None:
        """The first ``n`` slots in use are dead: they are no longer read."""
        for layer in self.layers:
            layer.offset += n

    def at(self, n: int, compiled_step: bool) -> None:
        """The next forward writes from slot ``n`` in use: a tensor offset for a compiled step, an int otherwise."""
        if compiled_step:
            # one launch for every layer's offset, not one per layer: on a GPU each is host time in every step
            counters = [layer.cumulative_length for layer in self.layers]
            torch._foreach_zero_(counters)
            torch._foreach_add_(counters, self.offset + n)
        for layer in self.layers:
            layer.end = None if compiled_step else self.offset + n

    def committed(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of every layer's first ``n`` slots in use."""
        end = self.offset + n
        return [(layer.keys[:, :, self.offset : end], layer.values[:, :, self.offset : end]) for layer in self.layers]
