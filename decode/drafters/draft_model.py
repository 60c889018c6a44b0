"""A draft model's drafts: a small causal LM (or a layer-skip view of the target) proposes a chain, or
for ``--verify rsd|spectr`` a tree of sampled siblings, one draft forward per drafted token."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from specdec.decode.drafters.base import Drafter, Proposal, Segment, TreeTemplate, draw
from specdec.decode.engine.cache import KVState
from specdec.decode.engine.length import LengthPolicy
from specdec.decode.engine.types import Scheme
from specdec.decode.engine.verify import logits_to_probs


class ModelDrafter(Drafter):
    """A causal LM drafting K tokens autoregressively with its own KV cache (draft model,
    layer-skip self-speculation). Its cache holds the committed text up to the last token it was
    fed plus its own drafts; after verification only the accepted drafts stay."""

    default_k = 4
    length_policy = LengthPolicy.before
    has_draft_probs = True
    # its steps run compiled as the job's target's do (``--compile``); a drafter drafting in a thread of its
    # own turns this off: two threads recording CUDA graphs at once break each other's capture
    records = True

    def __init__(self, model, scheme: Scheme | str = Scheme.standard, width: int = 2):
        """scheme rsd: each of the K draft steps proposes ``width`` siblings drawn from q without
        replacement; only the first is extended, so the draft still runs one chain. scheme spectr:
        ``width`` i.i.d. chains of K drafts (the draft runs them as width x B rows). Either way the
        target verifies a K x width tree (``verify.verify_tree_drafted``)."""
        self.model = model
        self.scheme, self.width = Scheme(scheme), width
        self.state: KVState | None = None
        self.fed: list[int] = []
        self._drafted = 0
        self._spine_width = 0  # siblings per level of the last RSD proposal (0: none)
        self._chains = 0  # chains of the last SpecTr proposal, the draft's rows widened to B x chains (0: none)
        self._templates: dict = {}

    @property
    def proposes_trees(self) -> bool:
        return self.scheme != Scheme.standard

    def _new_state(self, batch) -> KVState:
        """An empty cache for the batch's rows, its steps compiled as the job's are unless ``records`` is off."""
        return KVState(self.model, len(batch.seqs), batch.device, lean=True, compile=batch.compile if self.records else "off")

    def begin(self, batch, seg: Segment) -> None:
        # a draft is called once per drafted token: its per-call cost is what decode.engine.lean trims
        self.state = self._new_state(batch)
        self.fed = [0] * len(batch.seqs)

    def _feed_pending(self, batch, hidden: bool = False, extra: list[list[int]] | None = None):
        """Feed every row's not-yet-fed tokens, then the row's ``extra`` tokens (drafts: left padding keeps
        them every row's last slots); the last position's logits (and hidden state if asked)."""
        pending = [seq[f:] for seq, f in zip(batch.seqs, self.fed)]
        if extra is not None:
            pending = [p + e for p, e in zip(pending, extra)]
        width = max(map(len, pending))
        ids = torch.zeros(len(pending), width, dtype=torch.long)
        valid = torch.zeros(len(pending), width, dtype=torch.bool)
        for r, p in enumerate(pending):
            ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            valid[r, width - len(p) :] = True
        ids, valid = ids.to(batch.device), valid.to(batch.device)
        out = self.state.forward(ids, valid, hidden=hidden)
        self.state.commit_prefix(width, valid)
        self.fed = [len(seq) for seq in batch.seqs]
        return (out.logits[:, -1], out.hidden_states[-1][:, -1]) if hidden else out.logits[:, -1]

    def _pick(self, logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draw(logits, batch.sampling, batch.generator)

    def propose(self, batch) -> Proposal | None:
        if self.scheme == Scheme.rsd:
            return self._propose_siblings(batch, batch.num_draft)
        if self.scheme == Scheme.spectr:
            return self._propose_chains(batch, batch.num_draft)
        return self._propose_fixed(batch, batch.num_draft)

    def _siblings(self, logits: torch.Tensor, batch, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``width`` candidate tokens [B, width] at one draft step, the first a draw from q, and q."""
        if batch.sampling.greedy:
            return logits.topk(width, dim=-1).indices, None  # the limit of either scheme as T -> 0
        q = logits_to_probs(logits, batch.sampling)
        if self.scheme == Scheme.spectr:
            return torch.multinomial(q, width, replacement=True, generator=batch.generator), q
        # Gumbel-top-k over log q: the top tokens in order are successive draws without replacement
        u = torch.rand(q.shape, generator=batch.generator, device=q.device).clamp_(min=1e-20)
        return (q.log() - (-u.log()).log()).topk(width, dim=-1).indices, q

    def _propose_siblings(self, batch, k: int) -> Proposal | None:
        if k <= 0:
            return None
        width = max(1, min(self.width, self.model.config.vocab_size))
        logits = self._feed_pending(batch)
        tokens, probs = [], []
        for i in range(k):
            sibs, q = self._siblings(logits, batch, width)
            tokens.append(sibs)
            probs.append(q)
            if i < k - 1:
                out = self.state.forward(sibs[:, :1])
                self.state.commit_prefix(1, torch.ones_like(sibs[:, :1], dtype=torch.bool))
                logits = out.logits[:, -1]
        self._drafted = k - 1
        self._spine_width = width
        tpl = self._spine_template(k, width, batch.device)
        draft_probs = None if probs[0] is None else torch.stack(probs, 1).repeat_interleave(width, dim=1)
        tokens = torch.cat(tokens, 1)
        return Proposal(
            tokens=tokens,
            parents=tpl["parents"].expand(tokens.shape[0], -1),
            draft_probs=draft_probs,
            tree_attn=tpl["tree_attn"],
            depth=tpl["depth"],
            max_depth=k,
            scheme=self.scheme,
        )

    def _propose_chains(self, batch, k: int) -> Proposal | None:
        if k <= 0:
            return None
        width = max(1, min(self.width, self.model.config.vocab_size))
        bsz = len(batch.seqs)
        logits = self._feed_pending(batch)
        heads, q = self._siblings(logits, batch, width)  # i.i.d. heads (distinct top tokens when greedy)
        # every row's cache is copied to its chains: row r's chain j is row r * width + j
        self.state.select_rows(torch.arange(bsz, device=batch.device).repeat_interleave(width))
        self._chains = width
        tok = heads.reshape(-1)
        tokens, probs = [tok], [None if q is None else q.repeat_interleave(width, dim=0)]
        for _ in range(k - 1):
            out = self.state.forward(tok[:, None])
            self.state.commit_prefix(1, torch.ones_like(tok[:, None], dtype=torch.bool))
            tok, q = self._pick(out.logits[:, -1], batch)
            tokens.append(tok)
            probs.append(q)
        self._drafted = k - 1
        # chain-major nodes: node j * k + d is chain j's d-th draft
        tokens = torch.stack(tokens, 1).reshape(bsz, width * k)
        draft_probs = None if probs[0] is None else torch.stack(probs, 1).reshape(bsz, width * k, -1)
        tpl = self._chain_template(k, width, batch.device)
        return Proposal(
            tokens=tokens,
            parents=tpl["parents"].expand(bsz, -1),
            draft_probs=draft_probs,
            tree_attn=tpl["tree_attn"],
            depth=tpl["depth"],
            max_depth=k,
            scheme=self.scheme,
        )

    def _chain_template(self, k: int, width: int, device) -> dict:
        key = ("chains", k, width, str(device))
        if key not in self._templates:
            parents = [-1 if d == 0 else j * k + d - 1 for j in range(width) for d in range(k)]
            self._templates[key] = TreeTemplate(parents, [j if d == 0 else 0 for j in range(width) for d in range(k)]).tensors(device)
        return self._templates[key]

    def _spine_template(self, k: int, width: int, device) -> dict:
        """Level-major tree: node d * width + j is the j-th sibling at depth d + 1, child of node (d - 1) * width."""
        key = (k, width, str(device))
        if key not in self._templates:
            parents = [-1 if d == 0 else (d - 1) * width for d in range(k) for _ in range(width)]
            self._templates[key] = TreeTemplate(parents, [j for _ in range(k) for j in range(width)]).tensors(device)
        return self._templates[key]

    def _propose_fixed(self, batch, k: int) -> Proposal | None:
        if k <= 0:
            return None
        logits = self._feed_pending(batch)
        tokens, probs = [], []
        for i in range(k):
            tok, q = self._pick(self._step_logits(batch, logits, tokens), batch)
            tokens.append(tok)
            probs.append(q)
            if i < k - 1:
                out = self.state.forward(tok[:, None])
                self.state.commit_prefix(1, torch.ones_like(tok[:, None], dtype=torch.bool))
                logits = out.logits[:, -1]
        self._drafted = k - 1  # slots holding drafts d1..d_{k-1}
        draft_probs = None if probs[0] is None else torch.stack(probs, 1)
        return Proposal(tokens=torch.stack(tokens, 1), draft_probs=draft_probs)

    def _step_logits(self, batch, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        """The logits a chain step draws its token from, given the model's and the round's drafts so far."""
        return logits

    def observe(self, batch, seg: Segment) -> None:
        if self._drafted == 0 and seg.accepted is None:
            return
        if self._chains:
            # back to one cache row per text row: the chain the accepted path runs along (chain 0 if none)
            chain = torch.zeros_like(seg.keep_index[:, 0])
            if seg.keep_index.shape[1] > 1:
                chain = torch.where(seg.keep_valid[:, 1], (seg.keep_index[:, 1] - 1) // (self._drafted + 1), chain)
            rows = torch.arange(len(seg.accepted), device=chain.device) * self._chains + chain
            self.state.select_rows(rows)
            self._chains = 0
        keep = [min(a, self._drafted) for a in seg.accepted]
        if self._spine_width and seg.keep_index is not None and seg.keep_index.shape[1] > 1:
            # the cache holds the first siblings only: an accepted later sibling ends what it may keep
            nodes = seg.keep_index[:, 1:] - 1
            spine = torch.arange(nodes.shape[1], device=nodes.device)[None] * self._spine_width
            run = ((nodes == spine) & seg.keep_valid[:, 1:]).long().cumprod(-1).sum(-1).tolist()
            keep = [min(kp, r) for kp, r in zip(keep, run)]
        self.state.rollback(self._drafted, keep)
        self.fed = [f + kp for f, kp in zip(self.fed, keep)]
        self._drafted = 0
        self._spine_width = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self.state.select_rows(rows)
        idx = rows.tolist()
        self.fed = [self.fed[i] for i in idx]

    def admit(self, batch, seg: Segment) -> None:
        # the new prompts get a forward of their own now: fed lazily, each would widen the next round's
        # pending feed to a whole prompt for every row of the batch
        state = self._new_state(batch)
        state.forward(seg.input_ids, seg.input_valid)
        state.commit_prefix(seg.input_ids.shape[1], seg.input_valid)
        self.state.admit(state)
        self.fed += [len(seq) - 1 for seq in batch.seqs]  # the prompt; its first token (the root) is pending


# ---------------------------------------------------------------------------------------------
# S2D: a sorted draft's sub-model for this target (train.trainers.draft trains it, with ``specdec_s2d`` in its config)

# the config fields that make a target's identity at decode (``target_identity``): its architecture, read
# alike from the folder it was trained from and from the model a decode loaded (any dtype, device map)
_IDENTITY_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "rope_theta", "rope_parameters", "rope_scaling", "tie_word_embeddings", "sliding_window", "layer_types")


def target_identity(config) -> str:
    """A target's identity for S2D's depth rule: the sha256 (16 hex digits) of its decoder config's
    architecture fields (``_IDENTITY_KEYS``). Two targets of one architecture share it (their names
    then decide, ``s2d_depth``)."""
    from specdec.models.arch import text_config

    cfg = text_config(config) if not isinstance(config, dict) else config
    cfg = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    picked = {k: cfg.get(k) for k in _IDENTITY_KEYS if cfg.get(k) is not None}
    return hashlib.sha256(json.dumps(picked, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _source_names(source) -> set[str]:
    """The names a target's source answers to: as given, resolved when it is a folder, and its last part."""
    text = str(source)
    names = {text, text.rstrip("/").rsplit("/", 1)[-1]}
    if text and Path(text).is_dir():
        names.add(str(Path(text).resolve()))
    return {n for n in names if n}


def s2d_depth(meta: dict | None, config, name: str | None, layers: int) -> int:
    """The depth a sorted (S2D) draft of ``layers`` layers runs at for a target: the depth recorded for the
    recorded target whose identity (``target_identity``: its architecture's config hash) is this
    target's; where several recorded targets share it, the one whose source (as given, resolved, or its
    folder's name) matches ``name`` (the target's ``name_or_path``); else (no match, or still ambiguous)
    the full depth."""
    if not meta:
        return layers
    ident = target_identity(config)
    found = [t for t in meta.get("targets", []) if t.get("identity") == ident]
    if len(found) > 1 and name:
        wanted = _source_names(name)
        found = [t for t in found if wanted & (_source_names(t.get("source", "")) | {t.get("name", "")})]
    if len(found) != 1:
        return layers
    return max(1, min(int(found[0]["depth"]), layers))


def s2d_view(model, meta: dict | None, target):
    """(the draft as it serves ``target``, the depth it runs at): an S2D artifact's (``meta``: its config's
    ``specdec_s2d``) sub-model at the depth ``s2d_depth`` picks for the target, its top layers removed
    (``layer_skip_view``: weights shared; the final norm and the output layer stay); (model, None) for a
    draft that is not sorted."""
    if not meta:
        return model, None
    from specdec.models.views import layer_skip_view
    from specdec.models.arch import decoder_layers

    layers = len(decoder_layers(model)[2])
    depth = s2d_depth(meta, target.config, getattr(target, "name_or_path", None) or getattr(target.config, "_name_or_path", None), layers)
    if depth >= layers:
        return model, layers
    return layer_skip_view(model, list(range(depth, layers))), depth


class SortedExitDrafter(ModelDrafter):
    """S2D's depth chosen per draft step: a sorted draft's shallowest recorded sub-model drafts every step,
    and where a row's top probability under it is below ``threshold`` the step's token comes from the
    sub-model of the depth recorded for this target instead.

    The two sub-models share their first layers' weights but keep a cache each: the shallow one is fed
    every drafted token, the deep one only when a step needs it, catching up then in one forward on what
    it has not seen (the committed text since its last feed, the round's earlier drafts). A step runs the
    deep sub-model for every row when any row needs it, and takes its token for the rows that do. Each
    token's distribution is the one it was drawn from, so verification stays exact at any threshold."""

    def __init__(self, shallow, deep, threshold: float, depths: tuple[int, int] = (0, 0)):
        super().__init__(shallow)
        self.deep = ModelDrafter(deep)  # its ``_drafted``: the round's drafts it was fed (a prefix of them)
        self.threshold = float(threshold)
        self.depths = depths  # (shallow, deep) layer counts, for messages and reports
        self.steps = {"shallow": 0, "deep": 0}  # draft steps (rows x steps) whose token each sub-model gave

    @classmethod
    def from_sorted(cls, model, target, threshold: float) -> "SortedExitDrafter":
        from specdec.models.arch import decoder_layers
        from specdec.models.errors import UsageError
        from specdec.models.views import layer_skip_view

        meta = getattr(getattr(model, "config", None), "specdec_s2d", None)
        if not meta:
            raise UsageError("--exit-threshold needs a sorted (S2D) draft, one trained with train-draft --targets A,B")
        layers = len(decoder_layers(model)[2])
        deep, depth = s2d_view(model, meta, target)
        shallow = max(1, min(int(t["depth"]) for t in meta.get("targets", [])))
        if shallow >= depth:
            raise UsageError(f"--exit-threshold: this target runs the sorted draft at {depth} layer(s), its shallowest "
                             f"sub-model's depth; there is no shallower one to exit at")
        return cls(layer_skip_view(model, list(range(shallow, layers))), deep, threshold, (shallow, depth))

    def modules(self) -> list:
        return self.deep.modules()  # the shallow sub-model's weights are the deep one's first layers

    def cache_bytes(self) -> int:
        return super().cache_bytes() + self.deep.cache_bytes()

    def begin(self, batch, seg: Segment) -> None:
        super().begin(batch, seg)
        self.deep.begin(batch, seg)

    def _step_logits(self, batch, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        """The shallow sub-model's logits, or the deep one's for the rows whose top probability is below the
        threshold; the deep one is first fed what it lacks (committed text since its last feed, none once
        caught up this round, and the round's drafts it has not seen)."""
        unsure = torch.softmax(logits.float(), -1).amax(-1) < self.threshold
        n_unsure = int(unsure.sum())
        self.steps["deep"] += n_unsure
        self.steps["shallow"] += len(batch.seqs) - n_unsure
        if not n_unsure:
            return logits
        deep = self.deep
        new = drafts[deep._drafted :]
        extra = torch.stack(new, 1).tolist() if new else [[] for _ in batch.seqs]
        deep_logits = deep._feed_pending(batch, extra=extra)
        deep._drafted = len(drafts)
        return torch.where(unsure[:, None], deep_logits.to(logits.dtype), logits)

    def observe(self, batch, seg: Segment) -> None:
        self.deep.observe(batch, seg)  # keeps the accepted ones of the drafts it was fed
        super().observe(batch, seg)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.deep.select_rows(rows)

    def admit(self, batch, seg: Segment) -> None:
        super().admit(batch, seg)
        self.deep.admit(batch, seg)
