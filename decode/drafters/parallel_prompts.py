"""PPD (parallel prompt decoding) and Hidden Transfer: drafts predicted inside the target's own verify forward.

Both drafters declare ``ride_positions = m`` (``decode.drafters.base.Drafter``): the engine appends m positions
after each row's chain in every verify forward, at positions continuing after its last draft, seeing the
committed text, the root and all the row's drafts; their key/value slots are never committed. The drafter
injects its inputs there through forward hooks on the target (``riding``, entered by the engine around that
forward; the modules' ``injecting``, ``models.heads``):
  - PPD (``ppd`` artifacts, ``PromptTokens``): m trained soft prompt embeddings replace the input embeddings;
  - Hidden Transfer (``hidden-transfer`` artifacts, ``TransferMaps``): the output of decoder layer l at the
    riding positions is replaced by W_j h_l(last real position), run through the remaining layers.
Riding position j predicts the token two past the row's last real position, plus j: when the row accepts all
its drafts, the new root is the target's token after the last draft and the riding predictions are the chain
after it, proposed the next round (argmax: one-hot drafts, lossless at any temperature). A row that rejected a
draft proposes nothing that round; its next forward carries [root, riding positions], whose predictions are
valid again. Chains only (no trees), one chain per row.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.decode.drafters.base import Drafter, Proposal, Segment
from specdec.models.artifacts import check_fingerprint, read_config, tokenizer_fingerprint
from specdec.models.errors import SpecdecError
from specdec.models.head_artifacts import load_heads
from specdec.models.heads import RIDE_KINDS


class RidingDrafter(Drafter):
    """A drafter whose drafts are the predictions of positions riding the previous verify forward; ``heads``
    (a ``models.heads`` PromptTokens or TransferMaps, attached to ``target``) injects their inputs."""

    def __init__(self, heads, target, num_draft: int | None = None):
        self.heads, self.target = heads, target
        self.ride_positions = heads.num_heads
        self.default_k = heads.num_heads if num_draft is None else min(int(num_draft), heads.num_heads)
        self.next: torch.Tensor | None = None  # [B, m] each row's riding predictions of the last forward
        self.ready: torch.Tensor | None = None  # [B] bool: they follow the row's new root (it accepted every draft)

    def modules(self) -> list:
        return [self.heads] if isinstance(self.heads, torch.nn.Module) else []

    def ride_ids(self, bsz: int, device) -> torch.Tensor:
        return torch.full((bsz, self.ride_positions), self.heads.placeholder, dtype=torch.long, device=device)

    def riding(self, start: int, last: torch.Tensor):
        m = self.ride_positions
        cols = start + torch.arange(m, device=last.device)[None].expand(last.shape[0], m)
        return self.heads.injecting(cols, last[:, None].expand(-1, m))

    def begin(self, batch, seg: Segment) -> None:
        self.next, self.ready = None, torch.zeros(len(batch.seqs), dtype=torch.bool, device=batch.device)

    def propose(self, batch) -> Proposal | None:
        k = min(self.ride_positions, batch.num_draft)
        if self.next is None or k <= 0 or not bool(self.ready.any()):
            return None
        lengths = torch.where(self.ready, k, 0)
        return Proposal(tokens=self.next[:, :k], lengths=lengths)

    def observe(self, batch, seg: Segment) -> None:
        if seg.ride_logits is None:  # no position rode this forward (no room left for drafts)
            self.next, self.ready = None, torch.zeros(len(batch.seqs), dtype=torch.bool, device=batch.device)
            return
        drafted = seg.input_valid[:, 1:].sum(-1)
        accepted = torch.tensor(seg.accepted, device=drafted.device)
        self.ready = accepted == drafted
        self.next = self.heads.to_target(seg.ride_logits.argmax(-1))

    def select_rows(self, rows: torch.Tensor) -> None:
        self.ready = self.ready[rows]
        if self.next is not None:
            self.next = self.next[rows]

    def admit(self, batch, seg: Segment) -> None:
        """New rows propose nothing until a forward has carried their riding positions."""
        n = len(batch.seqs)
        self.ready = torch.cat([self.ready, torch.zeros(n, dtype=torch.bool, device=self.ready.device)])
        if self.next is not None:
            self.next = torch.cat([self.next, self.next.new_zeros(n, self.next.shape[1])])


def build_riding_drafter(artifact_dir: Path, target, tokenizer, options) -> Drafter:
    """Factory for ``--drafter DIR`` of kind ppd / hidden-transfer; ``options.num_draft`` caps the chain at the
    artifact's m riding positions."""
    cfg = read_config(artifact_dir)
    kind = cfg.get("kind")
    if kind not in RIDE_KINDS:
        raise SpecdecError(f"{artifact_dir} is not a {'/'.join(RIDE_KINDS)} artifact (kind {kind!r})")
    check_fingerprint(cfg["target"], tokenizer_fingerprint(tokenizer), f"{kind} artifact {artifact_dir}")
    heads, _ = load_heads(artifact_dir, target)
    return RidingDrafter(heads, target, getattr(options, "num_draft", None))
