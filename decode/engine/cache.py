"""KV cache bookkeeping for batched speculative decoding with per-row lengths.

Every row shares one slot axis in the HF cache. Each row keeps its own position counter and a
validity mask over the slots: a slot that a row did not keep (a rejected draft, left padding)
becomes a hole that row never attends to again. A verification round therefore appends
1 + max(accepted) slots for the whole batch, and no row waits for or redoes another row's work.
Positions are explicit (position_ids), so holes never shift a row's positions.

Keys and values live in preallocated buffers (``SlotBuffers``) written in place: a step appends
without copying the cache (``DynamicCache`` concatenates every layer's keys and values on every
forward, a fifth of a small model's decode time on a CPU), dropping a tail (rejected drafts) is only
bookkeeping, and the capacity grows by half when a forward would not fit. Eager forwards read the filled
slots only; compiled steps (``decode.engine.compiled``) read whole buffers at fixed shapes.

Sliding-window layers keep every key too (transformers' sliding cache layers keep only the last
window-1, which a shared slot axis with holes cannot use); the window lives in the mask instead,
from each slot's position per row. A model mixing full and sliding layers takes one mask per layer
type, ``{layer_type: mask}``, as its own forward builds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, StaticLayer

from specdec.decode.engine import compiled
from specdec.decode.engine.direct import direct_step
from specdec.decode.engine.lean import lean_output, lean_step
from specdec.models import arch
from specdec.models.masks import additive_mask


class SlotBook:
    """Which slots of the shared axis each row keeps (``valid`` [B, S]), the position id each slot holds
    per row (``positions`` [B, S], meaningless in holes) and each row's next position id: the
    bookkeeping of every cache with holes (the target's ``KVState``, the EAGLE drafter's own)."""

    def __init__(self, batch_size: int, device: torch.device):
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)  # [B, S]
        self.positions = torch.zeros(batch_size, 0, dtype=torch.long, device=device)  # [B, S]
        self.pos = torch.zeros(batch_size, dtype=torch.long, device=device)  # next position id per row

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def _append(self, keep_valid: torch.Tensor, keep_pos: torch.Tensor | None = None) -> None:
        """New slots after the committed ones; a row's position advances by the slots it keeps.
        keep_pos: their positions (default: a row's kept slots continue its text, holes not counted)."""
        if keep_pos is None:
            keep_pos = self.pos[:, None] + (keep_valid.long().cumsum(-1) - 1).clamp_(min=0)
        self.valid = torch.cat([self.valid, keep_valid], dim=1)
        self.positions = torch.cat([self.positions, keep_pos], dim=1)
        self.pos = self.pos + keep_valid.long().sum(-1)

    def _select(self, rows: torch.Tensor) -> None:
        self.valid = self.valid[rows]
        self.positions = self.positions[rows]
        self.pos = self.pos[rows]

    def _truncate(self, length: int, first: int = 0) -> None:
        """Keep slots first..length-1 of the axis."""
        self.valid = self.valid[:, first:length]
        self.positions = self.positions[:, first:length]

    def _admit(self, other: "SlotBook") -> None:
        """Append other's rows after these. The two slot axes are right-aligned on one axis as long as
        the longer: the shorter side's rows get holes on the left (positions are explicit per row, so
        a row's slot indices only matter to the masks)."""
        width = max(self.length, other.length)
        self.valid = torch.cat([left_pad(self.valid, width, False), left_pad(other.valid, width, False)], 0)
        self.positions = torch.cat([left_pad(self.positions, width, 0), left_pad(other.positions, width, 0)], 0)
        self.pos = torch.cat([self.pos, other.pos], 0)


def left_pad(x: torch.Tensor, width: int, value, dim: int = 1) -> torch.Tensor:
    """x padded with ``value`` on the left of ``dim`` to ``width``."""
    short = width - x.shape[dim]
    if short == 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([torch.full(shape, value, dtype=x.dtype, device=x.device), x], dim)


CAPACITY_STEP = 256  # buffer capacities are multiples of this (for compiled steps: one graph per capacity)


def capacity_for(slots: int) -> int:
    return -(-slots // CAPACITY_STEP) * CAPACITY_STEP


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
        for layer in self.layers:
            if compiled_step:
                layer.end = None
                layer.cumulative_length.fill_(self.offset + n)
            else:
                layer.end = self.offset + n

    def committed(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of every layer's first ``n`` slots in use."""
        end = self.offset + n
        return [(layer.keys[:, :, self.offset : end], layer.values[:, :, self.offset : end]) for layer in self.layers]


class KVState(SlotBook):
    def __init__(self, model, batch_size: int, device: torch.device, lean: bool = False, compile: str = "off"):
        """lean: run the model through ``decode.engine.lean``'s plain-function forward where it reproduces HF's
        (small Llama-architecture drafts; others keep HF's forward). compile: ``off``, or the mode decode
        steps run compiled in against preallocated buffers (``graphs``, ``inductor``:
        ``decode.engine.compiled``); on a GPU it takes precedence over lean, on a CPU lean does (a small
        draft's plain-function forward costs less per call than a compiled graph's guards and dispatch)."""
        super().__init__(batch_size, device)
        self.model = model
        types, window = arch.layer_types(model.config), arch.sliding_window(model.config)
        # the window applies where some layer slides; the full mask too where others do not
        self._window = window if window is not None and arch.SLIDING in types else None
        self._mixed = self._window is not None and arch.FULL in types
        # decode.engine.lean reproduces a forward that takes one mask
        lean = lean_step(model) if lean and not self._mixed else None
        if lean is not None and torch.device(device).type == "cpu":
            compile = "off"
        self._compiled = compiled.for_model(model, compile) if compile != "off" else None
        self._lean = lean if self._compiled is None else None
        # the decoder layers in one C++ call, the same floats (decode.engine.direct): for eager CPU forwards
        eager_cpu = self._compiled is None and self._lean is None and torch.device(device).type == "cpu"
        self._direct = direct_step(model, SlotBuffers) if eager_cpu else None
        # full cache layers only: every layer keeps every slot, sliding ones included; the buffers are
        # allocated at the first forward, when the shapes are known
        self.cache: SlotBuffers | None = None
        self._whole = False  # the last forward read whole buffers (a compiled step)
        # a prefix every row shares, held once (decode.engine.hydragen): per layer (keys, values) [1, Hkv, P, D]
        # in front of every row's slots, which then hold the rows' own suffixes only
        self.prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # one row that has only ever been given whole causal segments has no holes: its mask is the plain
        # causal one, which the model builds itself (or leaves to flash attention); see forward
        self._solid = batch_size == 1
        self._pending: torch.Tensor | None = None  # validity of the last forward's segment
        self._pending_pos: torch.Tensor | None = None  # and its positions
        # the Triton tree-attention kernel reads a bool mask; everything else gets an additive float mask
        self._bool_mask = model.config._attn_implementation == "specdec_tree"

    def cache_bytes(self) -> int:
        """The memory this state's keys and values take: the slot buffers and a shared prefix."""
        held = self.cache.nbytes() if self.cache is not None else 0
        return held + sum(k.nbytes + v.nbytes for k, v in (self.prefix or []))

    def forward(
        self,
        input_ids: torch.Tensor,
        input_valid: torch.Tensor | None = None,
        tree_attn: torch.Tensor | None = None,
        depth: torch.Tensor | None = None,
        hidden: bool | tuple = False,
        **model_kwargs,
    ):
        """Run the model on a segment appended after the cache.

        hidden: its hidden states too (``output_hidden_states``); a tuple of indices into them says which the
        caller reads (the others may be None where the forward skips keeping them).

        input_valid [B, T]: False marks holes (padding) inside the segment.
        tree_attn [B, T, T]: which segment tokens each token sees (a tree's ancestor matrix);
        default is causal. depth [B, T]: position offset of each token (default: count of valid
        tokens before it, so holes do not advance positions).
        """
        bsz, t = input_ids.shape
        if input_valid is not None or tree_attn is not None or depth is not None:
            self._solid = False
        # a sliding window hides nothing while the row is no longer than the window: the plain causal path
        # serves sliding layers too (Gemma 2/3, Mistral) until then
        within_window = self._window is None or self.length + t <= self._window
        if self._solid and within_window and self._lean is None and self._compiled is None and not self._bool_mask:
            return self._forward_causal(input_ids, hidden, model_kwargs)
        if input_valid is None:
            input_valid = torch.ones_like(input_ids, dtype=torch.bool)
        if depth is None:
            depth = (input_valid.long().cumsum(-1) - 1).clamp_(min=0)
        if tree_attn is None:
            tree_attn = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril_()[None].expand(bsz, t, t)
        # a compiled step runs at a bucketed length: the segment is padded with holes (logits_to_keep
        # would keep a hole's logits, so such forwards, the prefills, run eagerly)
        own = t  # the segment's own tokens; t becomes the length it runs at
        width = compiled.bucket(t) if self._compiled is not None and not model_kwargs else None
        if width is not None and width > t:
            pad, t = width - t, width
            input_ids, input_valid = F.pad(input_ids, (0, pad)), F.pad(input_valid, (0, pad), value=False)
            depth, tree_attn = F.pad(depth, (0, pad)), F.pad(tree_attn, (0, pad, 0, pad), value=False)
        self._reserve(self.length + t, compiled_step=width is not None)
        seg = tree_attn & input_valid[:, None, :]
        # each token sees itself, so a padded query never has an empty softmax row
        seg = seg | torch.eye(t, dtype=torch.bool, device=input_ids.device)[None]
        visible = torch.cat([self.valid[:, None, :].expand(bsz, t, self.length), seg], dim=-1)[:, None]
        positions = self.pos[:, None] + depth
        mask = self._mask(visible)
        if self._window is not None:
            # sliding layers: a key is visible iff query_pos - key_pos < window (transformers' sliding_window_overlay)
            keys = torch.cat([self.positions, positions], dim=1)
            near = (positions[:, :, None] - keys[:, None, :]) < self._window
            sliding = self._mask(visible & near[:, None])
            mask = {arch.FULL: mask, arch.SLIDING: sliding} if self._mixed else sliding
        if self.prefix is not None:
            model_kwargs = {**model_kwargs, "shared_prefix": self.prefix}
        if self._lean is not None and not model_kwargs:
            out = lean_output(*self._lean(input_ids, mask, positions, self.cache))
        else:
            forward = self._compiled.forward if width is not None else self.model
            out = self._call(forward, input_ids, mask, positions, hidden, model_kwargs)
        if width is not None:
            out = self._unpad(out, own)
        self._pending, self._pending_pos = input_valid[:, :own], positions[:, :own]
        return out

    def _forward_causal(self, input_ids: torch.Tensor, hidden: bool, model_kwargs: dict):
        """A segment of one row without holes after slots without holes: no mask is built or passed,
        so the attention implementation takes its causal path (flash attention's, SDPA's ``is_causal``)."""
        t = input_ids.shape[1]
        self._reserve(self.length + t)
        positions = self.pos[:, None] + torch.arange(t, device=input_ids.device)[None]
        out = self._call(self.model, input_ids, None, positions, hidden, model_kwargs)
        self._pending, self._pending_pos = torch.ones_like(input_ids, dtype=torch.bool), positions
        return out

    def _call(self, forward, input_ids, mask, positions, hidden: bool, model_kwargs: dict):
        """The model's forward (HF's, its compiled one, or its layers in one call) on a segment after the cache."""
        direct = self._direct if self._direct is not None and self._direct.model is forward else None  # not a view swapped in
        if direct is not None and direct.usable(input_ids, mask, model_kwargs, self.cache):
            return direct(input_ids, mask, positions, self.cache, hidden)
        return forward(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=bool(hidden),
            **model_kwargs,
        )

    def _unpad(self, out, t: int):
        """A compiled step's outputs for the segment's own tokens; copies where CUDA graphs would
        overwrite them at the next replay."""
        own = (lambda x: x[:, :t].clone()) if self._compiled.graphs else (lambda x: x[:, :t])
        out.logits = own(out.logits)
        if out.get("hidden_states") is not None:
            out.hidden_states = tuple(own(h) for h in out.hidden_states)
        return out

    def _reserve(self, slots: int, compiled_step: bool = False) -> None:
        """Buffers holding at least ``slots`` slots in use (grown by half at least, so growing is rare; at
        the same capacity when the dead head slots were what did not fit), the next write at the
        committed length."""
        if self.cache is None or self.cache.offset + slots > self.cache.capacity:
            old = self.cache.capacity if self.cache is not None else 0
            needed = slots + CAPACITY_STEP // 2
            capacity = old if needed <= old else capacity_for(max(needed, old + old // 2))
            if self.length:
                self.cache = SlotBuffers.holding(self._committed(), capacity, zeroed=self._compiled is not None, rows=self.cache.rows)
            else:
                layers = self.model.config.get_text_config().num_hidden_layers
                self.cache = SlotBuffers(layers, capacity, self.pos.device, zeroed=self._compiled is not None)
        self.cache.at(self.length, compiled_step)
        self._whole = compiled_step

    def _committed(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of the committed slots."""
        if self.cache is None or not self.length:
            return []
        return self.cache.committed(self.length)

    def _hold(self, kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int = 0) -> None:
        """The cache becomes one holding ``kv`` (per layer keys, values of the committed slots), with room
        for ``rows`` rows at least."""
        width = kv[0][0].shape[2] if kv else 0
        zeroed = self._compiled is not None
        self.cache = SlotBuffers.holding(kv, capacity_for(width + CAPACITY_STEP // 2), zeroed, rows) if width else None

    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        if self._whole:  # a compiled step's keys are the whole buffer
            head = self.cache.offset
            visible = F.pad(visible, (head, self.cache.capacity - head - visible.shape[-1]), value=False)
        if self._bool_mask:
            return visible.contiguous()
        # additive and materialised: CPU SDPA takes a very slow path for broadcast bool masks
        return additive_mask(visible, self.model.dtype)

    def commit_prefix(self, keep: int, keep_valid: torch.Tensor) -> None:
        """Keep the first ``keep`` slots of the last segment; keep_valid [B, keep] marks holes."""
        self._append(keep_valid[:, :keep], self._pending_pos[:, :keep])

    def commit_gather(self, index: torch.Tensor, keep_valid: torch.Tensor) -> None:
        """Keep, per row, the segment slots listed in index [B, M] (a tree's accepted path)."""
        t = self._pending.shape[1]
        m = index.shape[1]
        start = self.cache.offset + self.length
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                buf = getattr(layer, name)
                seg = buf[:, :, start : start + t]
                idx = index[:, None, :, None].expand(-1, buf.shape[1], -1, buf.shape[-1])
                buf[:, :, start : start + m] = seg.gather(2, idx)
        self._append(keep_valid, self._pending_pos.gather(1, index))

    def rollback(self, n_tail: int, keep: list[int]) -> None:
        """Of the last n_tail committed slots (speculative drafts), row r keeps its first keep[r]."""
        m = max(keep) if keep else 0
        base = self.length - n_tail
        kept = torch.tensor(keep, device=self.pos.device)
        tail = self.valid[:, base : base + m] & (torch.arange(m, device=self.pos.device)[None] < kept[:, None])
        self._truncate(base + m)
        self.valid = torch.cat([self.valid[:, :base], tail], dim=1)
        self.pos = self.pos - n_tail + kept

    def _append(self, keep_valid: torch.Tensor, keep_pos: torch.Tensor | None = None) -> None:
        super()._append(keep_valid, keep_pos)
        self._pending = self._pending_pos = None

    def admit(self, other: "KVState") -> None:
        """Append other's rows (a prefill of newly admitted requests, or an empty state) after these:
        the continuous-batching merge. Keys and values are aligned as ``SlotBook._admit`` aligns the
        slots; a side that holds no slots yet contributes holes. Two sides that share one prefix
        keep sharing it; otherwise each side's prefix is copied into its rows first. Where the buffers
        have room for the rows and the slots, the new rows are written in place (rows that finished
        left it): the running rows' keys and values are not copied."""
        if self.prefix is not other.prefix:
            self.materialize()
            other.materialize()
        width = max(self.length, other.length)
        total = self.valid.shape[0] + other.valid.shape[0]
        if self.cache is not None and other.length <= self.length and total <= self.cache.rows:
            self.cache.admit_rows(other._committed() or None, other.valid.shape[0], other.length, width)
        elif width:
            sides = [(state._committed() or state.valid.shape[0], state.length) for state in (self, other)]
            capacity = capacity_for(width + CAPACITY_STEP // 2)
            rows = self.cache.rows if self.cache is not None else 0
            self.cache = SlotBuffers.stacking(sides, width, capacity, zeroed=self._compiled is not None, rows=rows)
        else:
            self.cache = None
        self._admit(other)
        self._solid = False

    def share(self, n: int) -> "KVState":
        """A state of ``n`` rows that attend to this one-row state's slots as a prefix held once
        (``decode.engine.hydragen``), each with an empty suffix of its own."""
        out = KVState(self.model, n, self.pos.device, compile=self._compiled.mode if self._compiled is not None else "off")
        out.prefix = self._committed()
        out.pos = self.pos.expand(n).clone()
        out._solid = False  # the prefix needs the suffix mask passed through the attention function
        return out

    def materialize(self) -> None:
        """Copy a shared prefix into every row's slots (the state no longer shares it)."""
        if self.prefix is None:
            return
        bsz, width = self.valid.shape[0], self.prefix[0][0].shape[2]
        rows = self._committed()
        kv = []
        for i, (pk, pv) in enumerate(self.prefix):
            own = rows[i] if rows else (pk[:, :, :0].expand(bsz, -1, -1, -1), pv[:, :, :0].expand(bsz, -1, -1, -1))
            kv.append((torch.cat([pk.expand(bsz, -1, -1, -1), own[0]], 2), torch.cat([pv.expand(bsz, -1, -1, -1), own[1]], 2)))
        device = self.pos.device
        self.valid = torch.cat([torch.ones(bsz, width, dtype=torch.bool, device=device), self.valid], 1)
        self.positions = torch.cat([torch.arange(width, device=device).expand(bsz, -1), self.positions], 1)
        self.prefix = None
        self._hold(kv)

    def repeat(self, n: int) -> "KVState":
        """A state of ``n`` rows, each a copy of this one-row state (a prefix shared by every row,
        computed once)."""
        out = KVState.__new__(KVState)
        out.__dict__.update(self.__dict__)
        out._hold([(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in self._committed()])  # _hold copies
        out.valid, out.positions, out.pos = self.valid.expand(n, -1).clone(), self.positions.expand(n, -1).clone(), self.pos.expand(n).clone()
        out._solid = self._solid and n == 1
        out._pending = out._pending_pos = None
        return out

    def select_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows (rows: indices of the rows that continue, in their new order). The rows that
        stay move in place and the buffers keep their room, for rows admitted later; slots no remaining
        row uses at the head are dead weight every forward would read: they leave the slots in use."""
        length = self.length
        self._select(rows)
        if self.cache is None:
            return
        if rows.shape[0] > self.cache.rows:  # rows repeated past the buffers' room (a row drafting several chains)
            self._hold([(k[rows], v[rows]) for k, v in self._committed()])
            return
        self.cache.keep_rows(rows, length)
        used = self.valid.any(0)
        if length and not bool(used[0]):
            first = int(used.long().argmax().item()) if bool(used.any()) else length
            self.cache.drop_head(first)
            self._truncate(length, first)
