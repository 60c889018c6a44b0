"""Online speculative decoding: a draft model distilled on the queries it serves, while it serves them.

Every verification round already computes the target's distribution at the root and at each
accepted draft; ``OnlineDrafter`` keeps (context token ids, those target logits) per row and round,
and every ``every`` rounds takes a few AdamW steps of forward KL(p_target || q_draft) at T=1 on the
kept examples, rounds where the draft was rejected first (that is where it has something to learn).

Losslessness does not depend on the draft: verification is exact for any proposal, so changing
the draft's weights mid-job changes speed only. What must stay right is internal consistency:
  * training runs on a separate trainable copy made at construction (outside inference mode; the
    decode loop runs under ``torch.inference_mode``, whose tensors autograd refuses), on cloned
    data, and the result is copied into the drafting weights in place;
  * the lean forward (decode/engine/lean.py) caches fused q/k/v and gate/up weights and rebuilds them when
    a source weight's ``_version`` moved: in-place ``copy_`` bumps it, and a new ``KVState`` asks
    ``lean_step`` again, so the rebuilt cache below runs on the new weights;
  * the draft's KV cache holds keys computed by the old weights: after an update it is dropped and
    every row's text is fed again on the next ``propose`` (``fed`` = 0, as after ``begin``).
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specdec.decode.engine.cache import KVState
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.base import Segment
from specdec.decode.engine.types import Scheme


@dataclass
class _Example:
    context: torch.Tensor  # [L] token ids: committed text through the root and the accepted drafts
    teacher: torch.Tensor  # [n, V] target logits at the last n positions of ``context``
    rejected: bool  # the draft was wrong this round (some draft not accepted)


class OnlineDrafter(ModelDrafter):
    def __init__(
        self,
        model,
        every: int = 8,
        lr: float = 1e-4,
        steps: int = 2,
        batch_examples: int = 16,
        buffer: int = 64,
        max_context: int = 512,
        rebuild_cache: bool = True,
        scheme: Scheme | str = Scheme.standard,
        width: int = 2,
    ):
        # the drafting copy is updated in place as the job learns: a model shared with anything else (a
        # bench's other passes) stays as it was loaded
        super().__init__(copy.deepcopy(model), scheme=scheme, width=width)
        self.every, self.steps, self.batch_examples, self.max_context = max(1, every), steps, batch_examples, max_context
        self.rebuild_cache = rebuild_cache  # False only in tests: shows what a stale cache does
        # train in float32 at least (half-precision Adam updates underflow); float64 drafts stay float64
        dtype = torch.float64 if model.dtype == torch.float64 else torch.float32
        with torch.inference_mode(False):
            self.student = copy.deepcopy(model).to(dtype)
            for p in self.student.parameters():  # weights loaded under inference mode are not trainable
                p.data = p.data.clone()
                p.requires_grad_(True)
        self.student.train(False)  # eval mode throughout (gradients still flow): no dropout in the distillation
        self.opt = torch.optim.AdamW(self.student.parameters(), lr=lr, weight_decay=0.0)
        self.buffer: deque[_Example] = deque(maxlen=buffer)
        self.rounds = 0
        self.updates = 0
        self.losses: list[float] = []
        self._root_len: list[int] = []
        self._depth = 0

    def begin(self, batch, seg: Segment) -> None:
        super().begin(batch, seg)
        self._root_len = []

    def propose(self, batch):
        # where each row's root sits: observe reads the accepted drafts after it from the grown text
        self._root_len = [len(s) for s in batch.seqs]
        proposal = super().propose(batch)
        # drafts on the accepted path a row could have kept: fewer accepted means the draft was wrong
        self._depth = 0 if proposal is None else (proposal.max_depth if proposal.is_tree else proposal.tokens.shape[1])
        return proposal

    def observe(self, batch, seg: Segment) -> None:
        super().observe(batch, seg)
        if seg.accepted is None or len(self._root_len) != len(batch.seqs):
            return
        self._record(batch, seg, self._depth)
        self._root_len = []
        self.rounds += 1
        if self.rounds % self.every == 0 and self.buffer:
            self._update()
            if self.rebuild_cache:
                # the cache's keys and values came from the old weights: rebuild from each row's text
                self.state = KVState(self.model, len(batch.seqs), batch.device, lean=True, compile=batch.compile)
                self.fed = [0] * len(batch.seqs)

    def _record(self, batch, seg: Segment, drafted: int) -> None:
        with torch.inference_mode(False):
            for r, (seq, root_len, a) in enumerate(zip(batch.seqs, self._root_len, seg.accepted)):
                # teacher rows: the root (slot keep_index[r, 0]) and each accepted draft; a row that
                # finished inside its accepted drafts kept fewer of them in its text
                n = min(a, len(seq) - root_len) + 1
                slots = seg.keep_index[r, :n]
                teacher = seg.logits[r, slots].detach().clone()  # outside inference mode: a normal tensor
                context = torch.tensor(seq[: root_len + n - 1][-self.max_context :], dtype=torch.long)
                self.buffer.append(_Example(context, teacher, a < drafted))

    def _batch(self) -> list[_Example]:
        """Rejected rounds first (newest first), then the rest: what the draft got wrong is the signal."""
        newest = list(reversed(self.buffer))
        ordered = [e for e in newest if e.rejected] + [e for e in newest if not e.rejected]
        return ordered[: self.batch_examples]

    def _update(self) -> None:
        examples = self._batch()
        dev = next(self.student.parameters()).device
        with torch.inference_mode(False), torch.enable_grad():
            width = max(e.context.numel() for e in examples)
            ids = torch.zeros(len(examples), width, dtype=torch.long)
            mask = torch.zeros(len(examples), width, dtype=torch.long)
            for i, e in enumerate(examples):  # right-padded: default positions 0..L-1 stay right
                ids[i, : e.context.numel()] = e.context
                mask[i, : e.context.numel()] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            for _ in range(self.steps):
                logits = self.student(input_ids=ids, attention_mask=mask).logits
                kls = []
                for i, e in enumerate(examples):
                    end, n = e.context.numel(), e.teacher.shape[0]
                    log_q = F.log_softmax(logits[i, end - n : end].float(), -1)
                    log_p = F.log_softmax(e.teacher.to(dev).float(), -1)
                    p = log_p.exp()
                    # forward KL(p || q) at T=1; tokens the target rules out (-inf logits) add nothing, not nan
                    kls.append(torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1))
                loss = torch.cat(kls).mean()
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
                self.losses.append(float(loss.detach()))
        with torch.no_grad():
            # in place: the lean forward sees the bumped _version and rebuilds its fused weights
            for dst, src in zip(self.model.parameters(), self.student.parameters()):
                dst.copy_(src.detach().to(dst.dtype))
        self.updates += 1
