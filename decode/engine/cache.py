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

from specdec.decode.engine import compiled
from specdec.decode.engine.buffers import SlotBuffers
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


class KVState(SlotBook):
    def __init__(self, model, batch_size: int, device: torch.device, lean: bool = False, compile: str = "off",
                 kernels: str = "torch"):
        """lean: run the model through ``decode.engine.lean``'s plain-function forward where it reproduces HF's
        (small Llama-architecture drafts; others keep HF's forward). compile: ``off``, or the mode decode
        steps run compiled in against preallocated buffers (``graphs``, ``inductor``:
        ``decode.engine.compiled``); on a GPU it takes precedence over lean, on a CPU lean does (a small
        draft's plain-function forward costs less per call than a compiled graph's guards and dispatch).
        kernels: the engine's resolved kernel backend; recorded steps run fused kernels with ``triton``."""
        super().__init__(batch_size, device)
        self._kernels = kernels
        self.model = model
        types, window = arch.layer_types(model.config), arch.sliding_window(model.config)
        # the window applies where some layer slides; the full mask too where others do not
        self._window = window if window is not None and arch.SLIDING in types else None
        self._mixed = self._window is not None and arch.FULL in types
        # decode.engine.lean reproduces a forward that takes one mask
        lean = lean_step(model) if lean and not self._mixed else None
        if lean is not None and torch.device(device).type == "cpu":
            compile = "off"
        self._compiled = compiled.for_model(model, compile, kernels) if compile != "off" else None
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
        own = t  # the segment's own tokens; t becomes the length it runs at
        width = compiled.bucket(t) if self._compiled is not None and not model_kwargs else None
        if t == 1 and input_valid is None and tree_attn is None and depth is None:
            # one token after the cache (plain decoding's step): it sees the row's slots and itself, at the
            # row's next position. Built in a few launches: on a GPU each is host time in every step
            input_valid = torch.ones(bsz, 1, dtype=torch.bool, device=input_ids.device)
            self._reserve(self.length + 1, compiled_step=width is not None)
            visible = torch.cat([self.valid, input_valid], dim=1)[:, None, None]
            positions = self.pos[:, None]
        else:
            if input_valid is None:
                input_valid = torch.ones_like(input_ids, dtype=torch.bool)
            if depth is None:
                depth = (input_valid.long().cumsum(-1) - 1).clamp_(min=0)
            if tree_attn is None:
                tree_attn = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril_()[None].expand(bsz, t, t)
            # a compiled step runs at a bucketed length: the segment is padded with holes (logits_to_keep
            # would keep a hole's logits, so such forwards, the prefills, run eagerly)
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
        out = KVState(self.model, n, self.pos.device, compile=self._compiled.mode if self._compiled is not None else "off",
                      kernels=self._kernels)
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
