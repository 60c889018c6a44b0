"""SWIFT: layer-skip self-speculation whose skipped layers are searched during the job, no training.

The draft is the target with some decoder layers skipped (``layer_skip_view``, weights shared). Which
layers to skip is chosen on the fly from the acceptance the job actually sees:

* Start: the set ``layerskip`` skips by default (searched on calibration text: ``search_layerskip``).
* Candidates: only layers 1..L-2 may be skipped (the first and last layers carry the embedding and
  the unembedding geometry; dropping them ruins any draft). A candidate is a neighbour of the best
  set so far: one layer added, one removed, or one swapped for another, never empty and never every
  candidate layer; unevaluated neighbours come first (a seeded ``random.Random``, so a job is
  reproducible).
* Score of a round: tokens the round produced per unit of cost, ``mean(accepted + 1) / (1 + n * kept/L)``
  where ``n`` is the number of draft forwards and a draft forward costs ``kept/L`` of a target forward.
  Skipping more makes drafts cheaper, skipping less makes them better: the score weighs both. A set's
  score is the mean over the rounds it drafted.
* Optimisation phase: the first ``search_rounds`` drafting rounds give each candidate ``trial_rounds``
  rounds. Acceleration phase: the set with the best mean score drafts; every ``reeval_every`` rounds one
  new neighbour gets a trial (acceptance drifts with the text), and the best set's own mean keeps
  updating, so a set that stops paying is replaced.
* Early stop: within a round a row stops drafting once a draft token's top probability (of the
  tempered distribution at T > 0) falls below ``confidence``; that token is still proposed (it costs
  no extra draft forward). Rows stop independently: a chain Proposal with per-row ``lengths``.

Each skip set is a ``ModelDrafter`` over its own view with its own KV cache. A set that returns
after others drafted catches up lazily: ModelDrafter feeds every row's not-yet-fed text on its next
propose (a set new to a running batch starts with ``fed = 0`` and prefills every row's text). At most
``max_live`` sets keep a cache; the least recently used loses its cache beyond that.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import torch

from specdec.decode.engine.cache import KVState
from specdec.decode.drafters.base import Drafter, Proposal, Segment
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.engine.length import LengthPolicy
from specdec.models import arch
from specdec.models.views import layer_skip_view  # noqa: F401  (the view every skip set drafts with)
from specdec.models.errors import UsageError


class ConfidenceDrafter(ModelDrafter):
    """A ModelDrafter whose rows stop drafting when the draft's top probability drops below ``confidence``."""

    length_policy = LengthPolicy.own  # it decides each round's length itself

    def __init__(self, model, confidence: float = 0.6):
        super().__init__(model)
        self.confidence = confidence
        self.last_lengths: list[int] = []  # per-row lengths of the last proposal
        self.last_steps = 0  # draft forwards of the last proposal (the feed counts as one)

    def start(self, batch) -> None:
        """An empty cache for the current rows: the next propose prefills each row's whole text."""
        self.state = KVState(self.model, len(batch.seqs), batch.device, lean=True)
        self.fed = [0] * len(batch.seqs)
        self._drafted = 0

    def propose(self, batch) -> Proposal | None:
        kmax = batch.num_draft
        if kmax <= 0:
            return None
        logits = self._feed_pending(batch)
        bsz = logits.shape[0]
        lengths = [-1] * bsz  # -1 = still drafting
        open_rows = bsz
        one_slot = torch.ones(bsz, 1, dtype=torch.bool, device=logits.device)
        tokens, probs = [], []
        n = 0
        while True:
            tok, q = self._pick(logits, batch)
            tokens.append(tok)
            probs.append(q)
            n += 1
            top = (q if q is not None else torch.softmax(logits.float(), -1)).max(-1).values.tolist()
            for r in range(bsz):
                # the stop decision needs the confidence on the host: one sync per drafted token
                if lengths[r] < 0 and (n >= kmax or top[r] < self.confidence):
                    lengths[r] = n
                    open_rows -= 1
            if open_rows == 0:
                break
            out = self.state.forward(tok[:, None])
            self.state.commit_prefix(1, one_slot)
            logits = out.logits[:, -1]
        # drafts d1..d_{n-1} sit in the cache; no row accepts beyond its length, so the rollback holds
        self._drafted = n - 1
        self.last_lengths, self.last_steps = lengths, n
        draft_probs = None if probs[0] is None else torch.stack(probs, 1)
        uniform = all(x == n for x in lengths)  # the engine's plain chain path is cheaper then
        per_row = None if uniform else torch.tensor(lengths, dtype=torch.long, device=logits.device)
        return Proposal(tokens=torch.stack(tokens, 1), lengths=per_row, draft_probs=draft_probs)


class SwiftDrafter(Drafter):
    """Layer-skip self-speculation with the skip set searched online (see the module docstring)."""

    default_k = 8  # the most a round drafts; confidence usually stops it sooner
    has_draft_probs = True  # its members are draft models

    def __init__(self, target, confidence: float = 0.6, search_rounds: int = 32, trial_rounds: int = 2,
                 reeval_every: int = 48, max_live: int = 3, seed: int = 0, start: list[int] | None = None):
        self.target = target
        self.num_layers = len(arch.decoder_layers(target)[2])
        self.confidence = confidence
        self.search_rounds, self.trial_rounds, self.reeval_every = search_rounds, trial_rounds, reeval_every
        self.max_live = max(1, max_live)
        self.rng = random.Random(seed)
        self.layers = list(range(1, self.num_layers - 1))  # the layers a skip set may hold
        self.skip: frozenset[int] = frozenset(start or middle_layers(self.num_layers))
        self.scores: dict[frozenset[int], list[float]] = {}  # per set: the score of each round it drafted
        self.history: list[tuple[frozenset[int], float]] = []  # (set, score) per drafting round, in order
        self.rounds = 0  # drafting rounds so far
        self._trial_left = trial_rounds  # rounds the current set still drafts before the next decision
        self._views: dict[frozenset[int], torch.nn.Module] = {}
        self._live: OrderedDict[frozenset[int], ConfidenceDrafter] = OrderedDict()  # most recent last
        self._active: ConfidenceDrafter | None = None  # the set that drafted the round being verified

    # -- the search -------------------------------------------------------------------------------

    def mean_score(self, skip: frozenset[int]) -> float:
        s = self.scores.get(skip)
        return sum(s) / len(s) if s else float("-inf")

    def best(self) -> frozenset[int]:
        """The evaluated set with the best mean score (the start set before any round)."""
        return max(self.scores, key=self.mean_score) if self.scores else self.skip

    def round_score(self, skip: frozenset[int], accepted: list[int], steps: int) -> float:
        """Tokens produced per unit of cost: a draft forward costs kept/L of the target's forward."""
        kept = self.num_layers - len(skip)
        produced = sum(a + 1 for a in accepted) / max(len(accepted), 1)
        return produced / (1.0 + steps * kept / self.num_layers)

    def _neighbours(self, skip: frozenset[int]) -> list[frozenset[int]]:
        out = set()
        outside = [i for i in self.layers if i not in skip]
        for i in skip:
            out.add(skip - {i})
            for j in outside:
                out.add((skip - {i}) | {j})
        for j in outside:
            out.add(skip | {j})
        # a view must skip some but not every layer; candidates exclude the first and the last
        return sorted((s for s in out if s and s != skip), key=sorted)

    def _candidate(self) -> frozenset[int]:
        options = self._neighbours(self.best())
        unseen = [s for s in options if s not in self.scores]
        pool = unseen or options
        return self.rng.choice(pool) if pool else self.best()

    def _next_set(self) -> frozenset[int]:
        """After a round: keep drafting with the set on trial, or decide the next set."""
        self._trial_left -= 1
        if self._trial_left > 0:
            return self.skip
        searching = self.rounds < self.search_rounds
        reevaluate = self.reeval_every > 0 and self.rounds % self.reeval_every == 0
        if searching or reevaluate:
            self._trial_left = self.trial_rounds
            return self._candidate()
        self._trial_left = 1  # acceleration: the best set, decided again after each round
        return self.best()

    # -- one member per skip set ------------------------------------------------------------------

    def _member(self, skip: frozenset[int], batch) -> ConfidenceDrafter:
        member = self._live.get(skip)
        if member is None:
            if skip not in self._views:
                self._views[skip] = layer_skip_view(self.target, sorted(skip))
            member = ConfidenceDrafter(self._views[skip], self.confidence)
            member.start(batch)
            self._live[skip] = member
            while len(self._live) > self.max_live:
                self._live.popitem(last=False)  # its cache goes; it prefills again if it returns
        self._live.move_to_end(skip)
        return member

    # -- the Drafter protocol ---------------------------------------------------------------------

    def begin(self, batch, seg: Segment) -> None:
        # a new batch: every cache starts empty; what the search learned stays
        self._live.clear()
        self._active = None
        self._member(self.skip, batch)

    def propose(self, batch) -> Proposal | None:
        self._active = self._member(self.skip, batch)
        proposal = self._active.propose(batch)
        if proposal is None:
            self._active = None
        return proposal

    def observe(self, batch, seg: Segment) -> None:
        member, self._active = self._active, None
        if member is None:
            return
        member.observe(batch, seg)
        accepted = [min(a, n) for a, n in zip(seg.accepted, member.last_lengths)]
        score = self.round_score(self.skip, accepted, member.last_steps)
        self.scores.setdefault(self.skip, []).append(score)
        self.history.append((self.skip, score))
        self.rounds += 1
        self.skip = self._next_set()

    def select_rows(self, rows: torch.Tensor) -> None:
        for member in self._live.values():
            member.select_rows(rows)

    def admit(self, batch, seg: Segment) -> None:
        current = self._live.get(self.skip)
        for member in self._live.values():
            if member is current:
                member.admit(batch, seg)  # the set that drafts next prefills the new rows now
            else:
                # the others get holes for the new rows and feed their prompts when they draft again
                member.state.admit(KVState(member.model, len(batch.seqs), batch.device, lean=True))
                member.fed += [0] * len(batch.seqs)


def check_swift_spec(spec: str) -> float:
    """The early-stop threshold ``swift[:CONFIDENCE]`` names (default 0.6); a ``UsageError`` for another value."""
    _, _, arg = spec.partition(":")
    try:
        confidence = float(arg) if arg else 0.6
    except ValueError:
        raise UsageError(f"swift:{arg}: the confidence threshold must be a number in [0, 1]") from None
    if not 0.0 <= confidence <= 1.0:
        raise UsageError(f"swift:{arg}: the confidence threshold must be in [0, 1]")
    return confidence


def build_swift(spec: str, target, tokenizer, options) -> SwiftDrafter:
    """Factory for ``--drafter swift[:CONFIDENCE]``: the search order is seeded by ``--seed``."""
    return SwiftDrafter(target, confidence=check_swift_spec(spec), seed=options.sampling.seed,
                        start=search_layerskip(target, tokenizer))


# -- layer-skip views (layerskip, SWIFT's drafts) -----------------------------------------------


# what a searched skip set must keep: agreement of the layer-skip draft's greedy token with the target's,
# teacher-forced on calibration text. Chains of K drafts at agreement a give tau = (1 - a^(K+1)) / (1 - a):
# 0.6 gives 1.96 at K = 2, 2.2 at K = 3
SKIP_AGREEMENT = 0.6
_searched: dict = {}


def search_layerskip(model, tokenizer, agreement: float = SKIP_AGREEMENT) -> list[int]:
    """The layers ``layerskip`` skips by default: the most whose skipping keeps the draft's greedy token
    the target's on ``agreement`` of the positions of a calibration text (the shipped example prompts:
    code, data, docstrings). Layers are tried from the least important alone (each skipped on its own)
    and kept while the set as a whole still agrees; the first and last layers are never skipped. A
    model's result is remembered for the process and under $SPECDEC_HOME. Which layers a model can lose
    depends on the model: Gemma 3 270M loses almost nothing without layer 8 or 9, and everything without
    layer 1 or its first global-attention layer 5 (the middle half, once the default, agreed on 0 of 300
    code positions)."""
    n = len(arch.decoder_layers(model)[2])
    key = _model_key(model)
    if key in _searched:
        return _searched[key]
    disk = _skip_cache_path()
    stored = _read_json(disk).get(key)
    if stored is not None:
        _searched[key] = stored
        return stored
    import json as _json

    from specdec.examples import example_path

    texts = [_json.loads(line)["prompt"] for line in example_path("prompts.jsonl").read_text().splitlines()[:8]]
    try:
        ids = tokenizer("".join(texts), return_tensors="pt")["input_ids"][:, :160].to(next(model.parameters()).device)
    except (TypeError, AttributeError, KeyError):  # no tokenizer to encode the calibration text with
        return middle_layers(n)
    with torch.inference_mode():
        ref = model(ids).logits.argmax(-1)

        def agree(skip) -> float:
            got = layer_skip_view(model, sorted(skip))(ids).logits.argmax(-1)
            return float((got == ref).float().mean())

        alone = sorted(range(1, n - 1), key=lambda i: -agree([i]))
        chosen: list[int] = []
        for i in alone:
            if len(chosen) + 1 >= n - 2:
                break
            if agree(chosen + [i]) >= agreement:
                chosen.append(i)
    chosen = sorted(chosen) or [alone[0]]
    _searched[key] = chosen
    try:
        data = _read_json(disk)
        data[key] = chosen
        disk.parent.mkdir(parents=True, exist_ok=True)
        disk.write_text(_json.dumps(data, indent=1, sort_keys=True))
    except OSError:
        pass  # a read-only home searches again next time
    return chosen


def _model_key(model) -> str:
    """A model's identity for the skip-set cache: its name, depth and a digest of a few weights."""
    import hashlib

    _, _, layers = arch.decoder_layers(model)
    digest = hashlib.sha256()
    for p in (model.get_input_embeddings().weight, *(next(layer.parameters()) for layer in layers)):
        digest.update(repr(float(p.detach().flatten()[:4096].double().sum())).encode())
    return f"{getattr(model.config, 'model_type', '?')}-{len(layers)}-{digest.hexdigest()[:16]}"


def _skip_cache_path():
    from specdec.models.artifacts import specdec_home

    return specdec_home() / "layerskip.json"


def _read_json(path) -> dict:
    import json as _json

    try:
        return _json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def middle_layers(num_layers: int) -> list[int]:
    """The middle half of the layers (what ``layerskip`` skips when no calibration text can be encoded)."""
    lo, hi = num_layers // 4, num_layers - num_layers // 4
    return list(range(max(lo, 1), min(hi, num_layers - 1)))


def check_layerskip_spec(spec: str) -> list[int]:
    """The layers ``layerskip:2,3`` names (sorted, distinct; [] for bare ``layerskip``), before the target
    is known; ``parse_layerskip`` checks them against it."""
    _, _, arg = spec.partition(":")
    if not arg:
        return []
    try:
        return sorted({int(x) for x in arg.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"{spec!r}: layerskip:I,J,... names the layers to skip by integer index") from None


def parse_layerskip(spec: str, num_layers: int) -> list[int]:
    """``layerskip:2,3`` names the skipped layers (0-based); bare ``layerskip`` (searched, see
    ``search_layerskip``) returns [] here.

    A draft that skips nothing is the target itself, one that skips everything is no model: both,
    and targets too shallow to leave a useful draft, are usage errors."""
    if num_layers < 3:
        raise UsageError(f"layerskip needs a target with at least 3 decoder layers; this one has {num_layers}")
    if not spec.partition(":")[2]:
        return []
    skip = check_layerskip_spec(spec)
    bad = [i for i in skip if not 0 <= i < num_layers]
    if bad:
        raise UsageError(f"{spec!r}: the target has layers 0..{num_layers - 1}; no layer {bad[0]}")
    if not skip or len(skip) == num_layers:
        raise UsageError(f"{spec!r}: layerskip must skip some but not all of the target's {num_layers} layers")
    return skip
