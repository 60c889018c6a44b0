"""SpecDec++ adaptive draft length: a draft model that stops when its acceptance head loses faith.

When the draft proposes token i, the acceptance head reads what produced it (the draft's hidden
state there and the statistics of q, ``acceptance_features``): P_i = P(token i accepted | earlier
accepted). The decision comes before token i is fed, so a round that stops after n tokens costs the
n draft forwards of a fixed-length round, no more. A row stops when 1 - prod_i P_i > stop_threshold,
bounded by [min_draft, max_draft] (min_draft 0: a row whose first draft alone fails the rule proposes
nothing, so the round is a plain one and saves the speculative round's extra cost);
rows stop independently (a chain Proposal with per-row ``lengths``) and drafting ends when every
row has stopped. Rows that stopped keep drafting alongside the others (their extra tokens are
outside their length), which keeps one KV slot per draft step for the whole batch; the inherited
ModelDrafter.observe rollback stays correct because a row never accepts beyond its length.

An artifact holds two heads, because "accepted" means two different things: with sampling (T > 0)
token x is accepted with probability min(1, p(x)/q(x)); greedily (T = 0) the draft's argmax is
accepted iff it is the target's argmax. The drafter picks the head, and the stop policy, from the
decode mode of each round.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.base import Proposal
from specdec.decode.engine.length import LengthPolicy
from specdec.models.acceptance import HEAD_MODES, acceptance_features, greedy_features, load_acceptance_heads
from specdec.models.artifacts import check_fingerprint, read_config, tokenizer_fingerprint
from specdec.models.errors import SpecdecError


@dataclass(frozen=True)
class StopPolicy:
    """Stop a row's round when 1 - prod P_i > stop_threshold, with min_draft <= drafts <= max_draft."""

    stop_threshold: float = 0.3  # SpecDec++'s default
    min_draft: int = 2  # 0: a row whose first draft already fails the rule proposes nothing (a plain round)
    max_draft: int = 20

    def __post_init__(self):
        if not 0 < self.stop_threshold < 1 or self.min_draft < 0 or self.max_draft < max(self.min_draft, 1):
            raise ValueError("need 0 < stop_threshold < 1, min_draft >= 0 and max_draft >= max(min_draft, 1)")

    @property
    def fixed(self) -> bool:
        """min_draft == max_draft: every round drafts that many tokens whatever the head says (a fixed-K
        policy, which the default-policy search offers beside the adaptive ones)."""
        return self.min_draft == self.max_draft


class AdaptiveDrafter(ModelDrafter):
    """``head`` judges sampled drafts (T > 0) and, without a ``greedy_head``, greedy ones too.

    ``stop_threshold``/``min_draft``/``max_draft`` are the policy of sampling rounds; greedy rounds
    use ``greedy_policy`` (default: the same).
    """

    length_policy = LengthPolicy.own  # it decides each round's length itself

    def __init__(self, model, head, stop_threshold: float = 0.3, min_draft: int = 2, max_draft: int = 20,
                 greedy_head=None, greedy_policy: StopPolicy | None = None):
        super().__init__(model)
        sampling = StopPolicy(stop_threshold, min_draft, max_draft)
        self.policies = {"sampling": sampling, "greedy": greedy_policy or sampling}
        self.heads = {"sampling": head, "greedy": greedy_head if greedy_head is not None else head}
        self.default_k = max(p.max_draft for p in self.policies.values())  # the engine bounds it by the room left
        self._dtypes = {m: _dtype(h) for m, h in self.heads.items()}
        # the head runs once per drafted token: a head that offers ``fast()`` (AcceptanceHead) is called
        # through a plain function of its current weights, without nn.Module call overhead
        self._scorers = {m: h.fast() if hasattr(h, "fast") else h for m, h in self.heads.items()}
        self.last_lengths: torch.Tensor | None = None  # per-row lengths of the last proposal (for stats/tests)

    @property
    def head(self):
        return self.heads["sampling"]

    def propose(self, batch) -> Proposal | None:
        mode = "greedy" if batch.sampling.greedy else "sampling"
        policy, score, dtype = self.policies[mode], self._scorers[mode], self._dtypes[mode]
        kmax = min(policy.max_draft, batch.num_draft)
        if kmax <= 0:
            return None
        if policy.fixed:  # the bounds fix the length: the head could not change the round, so it is not run
            self.last_lengths = torch.full((len(batch.seqs),), kmax, dtype=torch.long, device=batch.device)
            return self._propose_fixed(batch, kmax)
        kmin = max(min(policy.min_draft, kmax), 1)  # the first decision comes with the first draft
        # stop when prod P_i < 1 - threshold, tracked as a sum of log-sigmoids on the host: the head's
        # output comes to the host once per step (the stop decision needs that sync anyway) and the
        # rule costs no further tensor ops
        log_floor = math.log1p(-policy.stop_threshold)
        logits, h = self._feed_pending(batch, hidden=True)
        bsz = logits.shape[0]
        log_keep = [0.0] * bsz  # log prod_i P_i per row
        lengths = [-1] * bsz  # -1 = still drafting
        skip_first = policy.min_draft == 0
        open_rows = bsz
        one_slot = torch.ones(bsz, 1, dtype=torch.bool, device=logits.device)
        tokens, probs, waiting = [], [], []
        n = 0
        while True:
            if mode == "greedy":
                tok, feats = greedy_features(h, logits)
                q = None
            else:
                tok, q = self._pick(logits, batch)
                feats = acceptance_features(h, logits, tok)
            tokens.append(tok)
            probs.append(q)
            n += 1
            waiting.append(feats)
            if n >= kmin:  # the first decision: judge every token so far in one head call
                feats = waiting[0][None] if len(waiting) == 1 else torch.stack(waiting)
                waiting = []
                for zs in score(feats.to(dtype)).tolist():
                    for r, z in enumerate(zs):
                        log_keep[r] += _log_sigmoid(z)
                for r in range(bsz):
                    if lengths[r] < 0 and (n >= kmax or log_keep[r] < log_floor):
                        # min_draft 0: a first draft that alone fails the rule is not worth a speculative round
                        lengths[r] = 0 if n == 1 and skip_first and log_keep[r] < log_floor else n
                        open_rows -= 1
            if open_rows == 0:
                break
            out = self.state.forward(tok[:, None], hidden=True)
            self.state.commit_prefix(1, one_slot)
            logits, h = out.logits[:, -1], out.hidden_states[-1][:, -1]
        self._drafted = n - 1  # drafts d1..d_{n-1} sit in the draft cache, as after a fixed-length round
        self.last_lengths = torch.tensor(lengths, dtype=torch.long, device=logits.device)
        if not any(lengths):  # every row skips: a plain round (the engine verifies the root alone)
            return None
        draft_probs = None if probs[0] is None else torch.stack(probs, 1)
        # rows of equal length (always at bs=1) need no per-row lengths: the engine's plain chain path is cheaper
        uniform = all(x == n for x in lengths)
        return Proposal(tokens=torch.stack(tokens, 1), lengths=None if uniform else self.last_lengths, draft_probs=draft_probs)


def _log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def _dtype(module) -> torch.dtype:
    return next(module.parameters()).dtype


def resolve_policies(artifact_policy: dict, options) -> dict[str, StopPolicy]:
    """The stop policy per decode mode: the artifact's chosen default (``config.json`` ``policy``; SpecDec++'s
    0.3 / 2 / 20 for artifacts without one), each field overridden by the user's option when given."""
    user = {f: getattr(options, f, None) for f in ("stop_threshold", "min_draft", "max_draft")}
    out = {}
    for mode in HEAD_MODES:
        base = {**dataclasses.asdict(StopPolicy()), **{k: v for k, v in (artifact_policy.get(mode) or {}).items() if k in user}}
        base.update({k: v for k, v in user.items() if v is not None})
        out[mode] = StopPolicy(float(base["stop_threshold"]), int(base["min_draft"]), int(base["max_draft"]))
    return out


def build_adaptive(acceptance_dir: Path, draft_model, options, tokenizer=None) -> AdaptiveDrafter:
    """Factory for ``--acceptance DIR``: options has stop_threshold, min_draft, max_draft (None: the
    artifact's default policy for the decode mode).

    The acceptance artifact's target fingerprint is checked against ``tokenizer`` (or
    ``options.tokenizer``) when one is given, and its hidden size against the draft's.
    """
    cfg = read_config(acceptance_dir)
    if cfg.get("kind") != "acceptance":
        raise SpecdecError(f"{acceptance_dir} is not an acceptance artifact (kind {cfg.get('kind')!r})")
    tokenizer = tokenizer if tokenizer is not None else getattr(options, "tokenizer", None)
    if tokenizer is not None:
        check_fingerprint(cfg["target"], tokenizer_fingerprint(tokenizer), f"acceptance head {acceptance_dir}")
    hidden = getattr(draft_model.config, "hidden_size", None)
    if hidden != cfg.get("hidden_size"):  # checked before the weights are read
        raise SpecdecError(
            f"acceptance head {acceptance_dir} was trained on a draft with hidden size {cfg.get('hidden_size')}, "
            f"this draft has {hidden}"
        )
    heads, _ = load_acceptance_heads(acceptance_dir)
    param = next(draft_model.parameters())
    for head in heads.values():
        head.to(device=param.device, dtype=param.dtype)
    policies = resolve_policies(cfg.get("policy") or {}, options)
    sampling = policies["sampling"]

    return AdaptiveDrafter(
        draft_model,
        heads["sampling"],
        stop_threshold=sampling.stop_threshold,
        min_draft=sampling.min_draft,
        max_draft=sampling.max_draft,
        greedy_head=heads["greedy"],
        greedy_policy=policies["greedy"],
    )
