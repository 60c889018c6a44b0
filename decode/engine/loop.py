"""The one decode loop: prefill -> (propose -> verify forward -> accept -> update caches)*.

Plain autoregressive decoding is the same loop with a drafter that proposes nothing, so every
method pays the same per-round overhead and ``ar`` is an honest baseline. Batched: each row has
its own accepted length, positions and stop state; finished rows leave the batch at once.
One host sync per round (the verdict), none inside drafting.

``generate`` decodes one static batch. ``stream`` batches continuously: it keeps ``batch_size`` rows
in flight, and the requests that take the places of finished rows are prefilled in a forward of
their own and merged into the running state (``KVState.admit``, ``Drafter.admit``) between rounds.
With ``prefill_chunk`` they join instead as rows of the target's state whose prompts ride along in
the verify forwards, a chunk a round (SARATHI): where a decode forward is bound by reading the
weights (a GPU at small batch), it computes a prompt's chunk for little more, and no forward is spent
on the prompt alone; on a CPU every padded token costs compute, and the prefill of its own is
cheaper. A joining row is not yet a row of the batch the drafter sees: its chunks' outputs are kept
and handed over as one prefill segment when its prompt is complete (``decode.engine.ride``).

Reading order: ``_run`` admits requests while places are free (``_admit``: ``_prefill``, a shared prompt
prefix computed once, ``decode.engine.hydragen``) and runs one ``_round`` at a time; a round is
propose (``Drafter.propose``, its chain cut by ``decode.engine.length``: ``_trim``), verify (``_verify``:
one target forward and ``decode.engine.verify``; PEARL's pre-verified rounds split it in two,
``decode.engine.split``), accept (``_accept``), let the drafter observe, drop finished rows
(``_drop_finished``) and let complete joining rows in (``_joined``). The engine reads the drafter only
through the contract in ``decode.drafters.base`` (its steps and declared capabilities).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from specdec.decode.engine import compiled, hydragen, split
from specdec.decode.engine.cache import KVState
from specdec.decode.engine.length import DraftLength, LengthPolicy
from specdec.decode.engine.own import append_tokens, eos_ids as _eos_ids
from specdec.decode.engine.ride import Joining, Ride, stack
from specdec.decode.drafters.base import Drafter, NoDrafter, Proposal, Segment, rides, tree_attention_from_parents
from specdec.decode.engine.types import GenRequest, GenResult, Scheme
from specdec.decode.engine.verify import (
    Sampling, Verdict, race_noise, race_scores, verify_chain, verify_tree, verify_tree_drafted,
)
from specdec.models import arch, head, threads
from specdec.models.errors import SpecdecError


GREEDY = Sampling()  # verification of race scores (verify.race_scores): their argmax is the draw


@dataclass
class Batch:
    """The state drafters may read: committed tokens per active row and the pending root token."""

    seqs: list[list[int]]  # prompt + committed tokens; the last one (root) is not yet in the target cache
    root: torch.Tensor  # [B]
    sampling: Sampling
    generator: torch.Generator
    device: torch.device
    num_draft: int
    rows: list[int] = field(default_factory=list)  # original request index of each active row
    compile: str = "off"  # the mode decode steps run compiled in (decode.engine.compiled): drafters' own caches too
    groups: list[int | None] = field(default_factory=list)  # each active row's ``GenRequest.group``
    references: list[list[int] | None] = field(default_factory=list)  # each active row's ``GenRequest.reference``
    keys: list[int] = field(default_factory=list)  # each active row's race identity (``GenRequest.key``)
    # the target's cache, for a drafter that drafts with the target's own layers in it (``Drafter.drafts_in_target``)
    target_state: object = None


@dataclass
class _Row:
    max_new: int
    start: float = 0.0  # when the row was admitted (perf_counter)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)
    widths: dict[int, int] = field(default_factory=dict)  # verify forwards by their width (bench's ideal speedup)
    group: int | None = None  # the request's group (its record's samples)
    cache_bytes: tuple[int, int] = (0, 0)  # the target's and the drafter's caches, for its whole batch, when it finished


class SpecEngine:
    """Decoding causal LMs: speculative decoding with any drafter (or none). ``generate`` takes one batch of
    requests and returns one result per request in the same order, as ``DiffusionGenerator.generate``
    does for diffusion LMs (the job runner does not care which); ``stream`` batches continuously."""

    expands_samples = False  # a record's --num-samples outputs are rows of their own (decode.engine.own)

    def __init__(
        self,
        target,
        tokenizer,
        drafter: Drafter | None = None,
        sampling: Sampling | None = None,
        num_draft: int | None = None,
        seed: int = 0,
        stop: list[str] | None = None,
        eos_ids: list[int] | None = None,
        kernels: str = "torch",
        shared_prefix: list[int] | str | None = None,
        min_shared: int = 32,
        admit_fraction: float = 0.25,
        compile: str = "auto",
        hold_prefix_once: bool = True,
        prefill_chunk: int = 0,
        adaptive_length: bool | None = None,
        first_finish: bool = False,
    ):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter or NoDrafter()
        self.sampling = sampling or Sampling()
        self.num_draft = self.drafter.default_k if num_draft is None else num_draft
        # chain lengths chosen each round by measured forward costs and acceptance (decode.engine.length): on a
        # CPU, where a wider verify forward costs more, and only when the user fixed no --num-draft
        policy = self.drafter.length_policy
        on_cpu = next(target.parameters()).device.type == "cpu"
        use_length = adaptive_length if adaptive_length is not None else (num_draft is None and on_cpu)
        self.length = None
        if use_length and policy is not LengthPolicy.own and self.num_draft > 0:
            # sampling: lengths from a fixed cost model, so a seeded job's draws do not depend on the machine's load
            timed = self.sampling.greedy
            share = 0.0 if timed else self.drafter.cost_share(target)
            self.length = DraftLength(self.num_draft, seed, timed=timed, draft_share=share)
        if policy is LengthPolicy.tree:
            self.drafter.length = self.length
        self.seed = seed
        # First Finish Search: a request group's samples race to finish (``_cancel_beaten``); per group, the
        # fewest tokens a sample of it finished with
        self.first_finish = first_finish
        self._first_finish: dict[int, int] = {}
        output = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
        self.vocab = output.weight.shape[0] if output is not None else target.config.get_text_config().vocab_size
        self.kernels = kernels
        self.stop = [s for s in (stop or []) if s]
        self.eos_ids = set(eos_ids if eos_ids is not None else _eos_ids(target, tokenizer))
        self.device = next(target.parameters()).device
        self.max_context = getattr(target.config, "max_position_embeddings", None) or 1 << 30
        # None: no sharing; "auto": detected; a token list: the user's (see _shared_prefix)
        self.shared_prefix = shared_prefix
        self.min_shared = min_shared
        self.admit_fraction = admit_fraction
        self.compile = compiled.resolve(compile, self.device)
        # prompt tokens a joining row prefills per round riding the verify forward (0: admitted rows are
        # prefilled in a forward of their own); a round whose verify forward is wider gives them its width
        self.prefill_chunk = prefill_chunk
        self._prefix: tuple | None = None  # (tokens, keep_all, one-row KVState, its Segment)
        # decided at the first shared prefix (see _hydragen); False: every row gets a copy
        self._prefix_held_once: bool | None = None if hold_prefix_once else False

    # -- the loop ---------------------------------------------------------------------------

    def generate(self, requests: list[GenRequest]) -> list[GenResult]:
        """Every request in one batch (static batching); results in request order."""
        results: list[GenResult | None] = [None] * len(requests)
        start = time.perf_counter()
        for i, res in self._run(iter(requests), max(len(requests), 1)):
            results[i] = res
        wall = round(time.perf_counter() - start, 6)
        for res in results:
            res.stats["batch_wall_s"] = wall
        return results

    def stream(self, requests: Iterable[GenRequest], batch_size: int) -> Iterator[tuple[int, GenResult]]:
        """Continuous batching: ``batch_size`` rows in flight; when rows finish, the next requests
        (read from ``requests`` only then) are prefilled and join the running batch. Yields
        (index of the request in ``requests``, its result) as each row finishes."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if not self.drafter.admits:
            raise SpecdecError(
                f"the {type(self.drafter).__name__} drafter cannot take new rows into a running batch "
                "(it implements no admit): decode with --schedule static"
            )
        return self._run(iter(requests), batch_size)

    def _should_admit(self, batch: Batch | None, batch_size: int, joining: int = 0) -> bool:
        """Admit into an empty batch at once, into a running one when ``admit_fraction`` of its places
        are free: each admission is a prefill forward of its own, which costs more than a place gains
        when rows finish every few rounds (fast drafters) and are replaced one at a time.
        Rows that join riding the verify forwards spend no forward of their own: one free place will do."""
        active = len(batch.rows) if batch is not None else 0
        free = batch_size - active - joining
        if not active and not joining:
            return True
        if free < 1:
            return False
        return self._may_ride(batch, joining) or free >= max(1, math.ceil(self.admit_fraction * batch_size))

    def _may_ride(self, batch: Batch | None, joining: int) -> bool:
        """Whether new rows can join the running state with their prompts riding its verify forwards:
        a split verification (PEARL's pre-verify) has no one forward to ride."""
        running = joining > 0 or (batch is not None and bool(batch.rows))
        # nor do drafters whose positions ride the verify forward (decode.drafters.base.Riding): one thing rides at a time
        return bool(self.prefill_chunk) and running and not self.drafter.pre_verify and not rides(self.drafter)

    @torch.inference_mode()
    def _run(self, requests: Iterator[GenRequest], batch_size: int) -> Iterator[tuple[int, GenResult]]:
        generator = torch.Generator(device=self.device).manual_seed(self.seed)
        rows: dict[int, _Row] = {}  # in flight, by request index
        batch: Batch | None = None
        state: KVState | None = None
        joining: list[Joining] = []
        taken = 0
        exhausted = False
        while True:
            # rows that finish at their first token free their place at once
            while not exhausted and self._should_admit(batch, batch_size, len(joining)):
                room = batch_size - (len(batch.rows) if batch is not None else 0) - len(joining)
                new = list(itertools.islice(requests, room))
                exhausted = len(new) < room
                if not new:
                    break
                index = list(range(taken, taken + len(new)))
                for i, r in zip(index, new):
                    rows[i] = _Row(max_new=r.max_new_tokens, start=time.perf_counter(), group=r.group)
                if self._may_ride(batch, len(joining)) and state.prefix is None and not self._shared_prefix(new):
                    state.admit(KVState(self.target, len(new), self.device, compile=self.compile, kernels=self.kernels))
                    joining += [Joining(r, i) for i, r in zip(index, new)]
                elif joining:
                    # a prompt with the shared prefix is prefilled on its own once the joining rows are rows
                    # of the batch (their state's row order is the batch's, then theirs)
                    requests, exhausted = itertools.chain(new, requests), False
                    for i in index:
                        del rows[i]
                    break
                else:
                    with self._head():
                        batch, state = self._admit(batch, state, new, index, rows, generator)
                taken += len(new)
                yield from self._finished(rows)
            if not joining and (batch is None or not batch.rows):
                return
            threads.tick()  # intra-op threads follow the cores other processes leave free (models.threads)
            with self._head():
                batch = self._round(batch, state, joining, rows, generator)
            yield from self._finished(rows)

    def _round(self, batch: Batch, state: KVState, joining: list[Joining], rows: dict[int, "_Row"], generator) -> Batch:
        """One round: propose, verify in one target forward, accept, let the drafter observe; finished
        rows leave and joining rows whose prompts are complete join. Returns the batch."""
        proposal = None
        if batch.rows:
            room = self.max_context - max(map(len, batch.seqs))
            batch.num_draft = self.num_draft if room > self.num_draft + 1 else 0
            if self.drafter.drafts_in_target:
                # its forwards write the target's cache: not while joining rows' prompts ride the verify forward
                batch.target_state, batch.num_draft = state, 0 if joining else batch.num_draft
            if self.length is not None and self.drafter.length_policy is LengthPolicy.before and batch.num_draft:
                batch.num_draft = max(self.length.lengths([0] * len(batch.rows), [batch.num_draft] * len(batch.rows)))
            start = time.perf_counter()
            proposal = self.drafter.propose(batch) if batch.num_draft > 0 else None
            if self.length is not None and proposal is not None and not proposal.is_tree and proposal.rest is None:
                # a drafter that sizes its trees itself times its own levels; its chains (a lookup's,
                # decode.drafters.hybrid) cost no draft forward and would dilute that timing
                if self.drafter.length_policy is not LengthPolicy.tree:
                    self.length.record_draft(proposal.tokens.shape[1], time.perf_counter() - start)
                if self.drafter.length_policy is LengthPolicy.after:
                    proposal = self._trim(proposal)
        if proposal is not None and proposal.rest is not None:
            seg, verdict, proposal = split.verify(self, state, batch, proposal)
        elif proposal is not None and proposal.states is not None:
            seg, verdict = self._verify_states(state, batch, proposal)
        else:
            seg, verdict = self._verify(state, batch, proposal, joining)
        if batch.rows:
            emitted = self._accept(batch, rows, proposal, verdict)
            seg.accepted = emitted
            if self.length is not None and proposal is not None and not proposal.is_tree:
                drafted = proposal.lengths.tolist() if proposal.lengths is not None else [proposal.tokens.shape[1]] * len(emitted)
                self.length.observe(proposal.classes or [0] * len(emitted), drafted, emitted)
            self.drafter.observe(batch, seg)
        self._drop_finished(batch, rows, state, len(joining))
        if any(j.complete for j in joining):
            batch = self._joined(batch, state, joining, rows, generator)
        return batch

    def _trim(self, proposal: Proposal) -> Proposal | None:
        """The proposal with each row's chain cut to the length decode.engine.length chooses for it (None when
        every row is cut to nothing: the round is a plain step)."""
        n = proposal.tokens.shape[1]
        have = proposal.lengths.tolist() if proposal.lengths is not None else [n] * proposal.tokens.shape[0]
        classes = proposal.classes or [0] * len(have)
        keep = self.length.lengths(classes, have)
        width = max(keep)
        if width == 0:
            return None
        proposal.tokens = proposal.tokens[:, :width]
        proposal.lengths = torch.tensor(keep, device=proposal.tokens.device)
        if proposal.draft_probs is not None:
            proposal.draft_probs = proposal.draft_probs[:, :width]
        return proposal

    def _head(self):
        """The target's output layer as ``models.head`` runs it inside the engine: greedy rounds read it
        screened in half precision (each position's argmax exact), sampling rounds exactly."""
        return head.scope(self.target, greedy=self.sampling.greedy)

    def _admit(self, batch: Batch | None, state: KVState | None, requests, index, rows, generator) -> tuple[Batch, KVState]:
        """Prefill ``requests`` (their own forward, left-padded among themselves) and merge them into the
        running batch; into an empty batch they start a new one (the drafter ``begin``s)."""
        new, new_state, seg = self._prefill(requests, index, rows, generator)
        if batch is None or not batch.rows:
            self.drafter.begin(new, seg)
            batch, state = new, new_state
        else:
            self.drafter.admit(new, seg)
            state.admit(new_state)
            self._merge(batch, new)
        self._drop_finished(batch, rows, state)
        return batch, state

    @staticmethod
    def _merge(batch: Batch, new: Batch) -> None:
        """``new``'s rows after ``batch``'s."""
        batch.seqs += new.seqs
        batch.rows += new.rows
        batch.groups += new.groups
        batch.references += new.references
        batch.keys += new.keys
        batch.root = torch.cat([batch.root, new.root])

    def _prefill(self, requests, index, rows, generator) -> tuple[Batch, KVState, Segment]:
        bsz = len(requests)
        prefix = self._shared_prefix(requests)
        width = max(len(r.prompt_ids) for r in requests) - len(prefix)
        ids = torch.zeros(bsz, width, dtype=torch.long)
        valid = torch.zeros(bsz, width, dtype=torch.bool)
        for i, r in enumerate(requests):
            suffix = r.prompt_ids[len(prefix) :]
            ids[i, width - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
            valid[i, width - len(suffix) :] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        keep_all = self.drafter.needs_prefill_logits
        if prefix:
            # the shared prefix's keys and values are computed once, and held once for every row
            # (decode.engine.hydragen) or copied to each; each row's suffix follows it (left-padded among the
            # suffixes: holes between prefix and suffix)
            head, head_seg = self._prefix_state(prefix, keep_all)
            state = head.share(bsz) if self._hydragen() else head.repeat(bsz)
        else:
            state = KVState(self.target, bsz, self.device, compile=self.compile, kernels=self.kernels)
        # one prompt has no padding: no validity given keeps the state's mask-free causal path open
        out = state.forward(ids, valid if bsz > 1 else None, hidden=self.wants_hidden, **({} if keep_all else {"logits_to_keep": 1}))
        state.commit_prefix(width, valid)
        seg = Segment(ids, valid, out.logits, *self.hidden_of(out))
        if prefix:
            seg = _join(head_seg, seg, bsz, keep_all)
            ids, valid = seg.input_ids, seg.input_valid
        return self._new_batch(requests, index, out.logits[:, -1:], rows, generator), state, seg

    def _new_batch(self, requests, index, last_logits: torch.Tensor, rows: dict[int, _Row], generator) -> Batch:
        """The batch of prefilled ``requests``, each row's first token drawn from its last prompt token's
        logits [B, 1, V]."""
        empty = torch.zeros(len(requests), 0, dtype=torch.long, device=self.device)
        keys = [i if r.key is None else r.key for r, i in zip(requests, index)]
        if self.sampling.race:  # the first token of each request is raced like every other (verify.race_noise)
            positions = torch.tensor([[len(r.prompt_ids)] for r in requests])
            noise = race_noise(self.seed, keys, positions, last_logits.shape[-1], self.device)
            verdict = verify_chain(race_scores(last_logits, noise, self.sampling.temperature), empty, None, GREEDY, generator)
        else:
            verdict = verify_chain(last_logits, empty, None, self.sampling, generator)
        batch = Batch(
            seqs=[list(r.prompt_ids) for r in requests],
            root=verdict.next_token,
            sampling=self.sampling,
            generator=generator,
            device=self.device,
            num_draft=self.num_draft,
            rows=list(index),
            groups=[r.group for r in requests],
            references=[r.reference for r in requests],
            keys=keys,
            compile=self.compile,
        )
        first = verdict.next_token.tolist()
        for i, tok in enumerate(first):
            row = rows[index[i]]
            row.target_calls += 1
            self._append(row, batch.seqs[i], [tok])
        return batch

    # -- shared prefixes ----------------------------------------------------------------------

    def _shared_prefix(self, requests) -> list[int]:
        """The prefix every prompt of this prefill shares and the engine computes once: the user's
        (``shared_prefix`` a token list), or with ``"auto"`` the one cached from earlier prefills when
        every prompt starts with it, else the longest common prefix of two or more prompts when it has
        ``min_shared`` tokens. Each prompt keeps at least one token of its own (the prefill's logits)."""
        if not self.shared_prefix:
            return []
        prompts = [r.prompt_ids for r in requests]

        def shared_by_all(prefix) -> bool:
            return bool(prefix) and all(len(p) > len(prefix) and p[: len(prefix)] == prefix for p in prompts)

        if self.shared_prefix != "auto":
            return list(self.shared_prefix) if shared_by_all(list(self.shared_prefix)) else []
        cached = list(self._prefix[0]) if self._prefix else []
        if shared_by_all(cached):
            return cached
        if len(prompts) < 2:
            return []
        n = min(len(p) for p in prompts) - 1
        for i in range(n):
            tok = prompts[0][i]
            if any(p[i] != tok for p in prompts):
                n = i
                break
        return prompts[0][:n] if n >= self.min_shared else []

    def _hydragen(self) -> bool:
        """Whether rows hold a shared prefix once (decode.engine.hydragen) rather than a copy each: where the
        target's attention allows it."""
        if self._prefix_held_once is None:
            self._prefix_held_once = hydragen.enable(self.target, self.kernels)
        return self._prefix_held_once

    def _prefix_state(self, prefix: list[int], keep_all: bool) -> tuple[KVState, Segment]:
        """A one-row state holding ``prefix`` and its segment, computed once and kept for the next prefills."""
        key = (tuple(prefix), keep_all)
        if self._prefix is None or self._prefix[0] != key[0] or self._prefix[1] != keep_all:
            ids = torch.tensor([prefix], dtype=torch.long, device=self.device)
            valid = torch.ones_like(ids, dtype=torch.bool)
            state = KVState(self.target, 1, self.device, compile=self.compile, kernels=self.kernels)
            out = state.forward(ids, None, hidden=self.wants_hidden, **({} if keep_all else {"logits_to_keep": 1}))
            state.commit_prefix(ids.shape[1], valid)
            self._prefix = (key[0], keep_all, state, Segment(ids, valid, out.logits, *self.hidden_of(out)))
        return self._prefix[2], self._prefix[3]

    def _verify(self, state: KVState, batch: Batch, proposal: Proposal | None, joining: list[Joining] = ()) -> tuple[Segment, Verdict]:
        """One target forward over [root, drafts...] and the shared verification routine. The prompts of
        ``joining`` rows ride along, a chunk each, in rows of their own after the batch's; or the drafter's
        riding positions (``decode.drafters.base.Riding``: PPD, Hidden Transfer) follow each row's chain, their
        outputs handed over in the segment (``ride_logits``), their slots never committed."""
        bsz = len(batch.seqs)
        root = batch.root[:, None]
        hidden = self.wants_hidden
        if proposal is None or proposal.tokens.shape[1] == 0:
            proposal = Proposal(tokens=torch.zeros(bsz, 0, dtype=torch.long, device=self.device))
        n = proposal.tokens.shape[1]
        input_ids = torch.cat([root, proposal.tokens], dim=1)
        ones = torch.ones(bsz, 1, dtype=torch.bool, device=self.device)
        attn = depth = None
        if proposal.is_tree:
            valid = torch.cat([ones, proposal.parents >= -1], dim=1)
            attn, depth = proposal.tree_attn, proposal.depth
            if attn is None:
                attn, depth = tree_attention_from_parents(proposal.parents)
        else:
            lengths = proposal.lengths
            steps = torch.arange(n, device=self.device)[None]
            valid = torch.cat([ones, steps < lengths[:, None]] if lengths is not None else [ones, ones.expand(bsz, n)], dim=1)
        tree = (attn.expand(bsz, -1, -1), depth.expand(bsz, -1)) if proposal.is_tree else (None, None)
        ride = Ride(self, joining, 1 + n) if joining else None
        # the race (verify.race_noise) where every draft is one-hot: the logits become race scores and
        # verification is the greedy prefix match on them
        noise = None
        if bsz and self.sampling.race and proposal.draft_probs is None and proposal.scheme == Scheme.standard:
            offsets = tree[1] if proposal.is_tree else torch.arange(1 + n, device=self.device)[None].expand(bsz, -1)
            positions = torch.tensor([len(s) for s in batch.seqs])[:, None] + offsets.cpu()
            positions.masked_fill_(~valid.cpu(), -1)  # slots past a row's drafts draw nothing
            noise = race_noise(self.seed, batch.keys, positions, self.vocab, self.device)
        sampling = GREEDY if noise is not None else batch.sampling
        # the drafter's riding positions (decode.drafters.base.Riding) follow each row's chain: valid, at positions
        # continuing after its last draft, causal; their outputs are split off after the forward and their
        # slots are never committed (commit_prefix keeps the first 1 + accepted slots only)
        m = self.drafter.ride_count(1 + n) if bsz and batch.num_draft > 0 and rides(self.drafter) and ride is None else 0
        riding = contextlib.nullcontext()
        if m:
            last = proposal.lengths if proposal.lengths is not None else torch.full((bsz,), n, device=self.device)
            riding = self.drafter.riding(1 + n, last)
            input_ids = torch.cat([input_ids, self.drafter.ride_ids(bsz, self.device, m)], dim=1)
            valid = torch.cat([valid, ones.expand(bsz, m)], dim=1)
            layout = self.drafter.ride_layout(1 + n, last, valid, tree)
            if layout is not None:  # chains blind to each other (PPD's ensemble), a chain per tree node: the drafter's mask
                tree = layout
            elif proposal.is_tree:
                raise SpecdecError(f"the {type(self.drafter).__name__} drafter rides the verify forward: it proposes chains, not trees")
        ride_logits = ride_hidden = None
        if ride is None:
            start = time.perf_counter()
            # riding positions: the raced output layer would take noise for every position; race_scores below instead
            flat = noise.view(-1, self.vocab) if noise is not None and not m else None
            with head.racing(self.target, flat, self.sampling.temperature) as raced, riding:
                out = state.forward(input_ids, valid if proposal.is_tree or proposal.lengths is not None or tree[0] is not None else None,
                                    *tree, hidden=hidden)
            if self.length is not None:  # a CPU forward is done when it returns
                self.length.record_forward(bsz, input_ids.shape[1], time.perf_counter() - start)
            logits, (last_hidden, layers) = out.logits, self.hidden_of(out)
            if m:  # the riding positions' outputs go to the drafter; everything below sees [root, drafts...] only
                ride_logits, logits = logits[:, 1 + n :], logits[:, : 1 + n]
                if last_hidden is not None:
                    ride_hidden, last_hidden = last_hidden[:, 1 + n :], last_hidden[:, : 1 + n]
                    layers = tuple(h[:, : 1 + n] for h in layers) if layers is not None else None
                input_ids, valid = input_ids[:, : 1 + n], valid[:, : 1 + n]
            if noise is not None and not raced["applied"]:
                logits = race_scores(logits, noise, self.sampling.temperature)
        else:
            out = state.forward(*ride.inputs(input_ids, valid, *tree), hidden=hidden, **ride.model_kwargs)
            logits, last_hidden, layers = ride.split(out, bsz)
            if noise is not None:
                logits = race_scores(logits, noise, self.sampling.temperature)
        verdict = None
        if not bsz:  # only joining rows: nothing to verify
            index = torch.zeros(0, 0, dtype=torch.long, device=self.device)
            keep_valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)
        elif proposal.is_tree:
            max_depth = proposal.max_depth or int(depth.max().item())
            if proposal.scheme == Scheme.standard:
                verdict = verify_tree(
                    logits, proposal.tokens, proposal.parents, sampling, batch.generator, max_depth, attn, depth
                )
            else:  # siblings sampled from the draft's q: the proposal names the scheme that keeps p exact
                verdict = verify_tree_drafted(
                    logits, proposal.tokens, proposal.parents, proposal.draft_probs, proposal.scheme,
                    batch.sampling, batch.generator, max_depth, attn, depth,
                )
            keep = 1 + int(verdict.accepted.max().item())
            index = torch.cat([torch.zeros_like(root), verdict.path[:, : keep - 1] + 1], dim=1).clamp_(min=0)
            keep_valid = torch.arange(keep, device=self.device)[None] <= verdict.accepted[:, None]
        else:
            verdict = verify_chain(
                logits, proposal.tokens, proposal.draft_probs, sampling, batch.generator, proposal.lengths, self.kernels
            )
            # plain decoding's round keeps its one slot: no wait on the device to learn that
            keep = 1 + int(verdict.accepted.max().item()) if n else 1
            index = torch.arange(keep, device=self.device)[None].expand(bsz, keep)
            keep_valid = index <= verdict.accepted[:, None]
        commit_index, commit_valid = (index, keep_valid) if ride is None else ride.keep(index, keep_valid)
        if proposal.is_tree:
            state.commit_gather(commit_index, commit_valid)
        else:  # every row keeps the first slots of its segment
            state.commit_prefix(commit_index.shape[1], commit_valid)
        seg = Segment(input_ids, valid, logits, last_hidden, layers, keep_index=index, keep_valid=keep_valid,
                      ride_logits=ride_logits, ride_hidden=ride_hidden)
        return seg, verdict

    def _verify_states(self, state: KVState, batch: Batch, proposal: Proposal) -> tuple[Segment, Verdict]:
        """Verification of a chain whose root and drafts the drafter already fed through the target's layers in
        its cache (``Proposal.states``, N + 1 slots committed): the output layer on those states gives the
        logits a verify forward would, and the cache keeps each row's root and accepted drafts."""
        bsz, n = proposal.tokens.shape
        logits = arch.output_logits(self.target, proposal.states)
        verdict = verify_chain(logits, proposal.tokens, proposal.draft_probs, batch.sampling, batch.generator, None, self.kernels)
        accepted = verdict.accepted.tolist()
        state.rollback(n + 1, [1 + a for a in accepted])
        keep = 1 + max(accepted)
        index = torch.arange(keep, device=self.device)[None].expand(bsz, keep)
        input_ids = torch.cat([batch.root[:, None], proposal.tokens], dim=1)
        seg = Segment(input_ids, torch.ones_like(input_ids, dtype=torch.bool), logits, None,
                      keep_index=index, keep_valid=index <= verdict.accepted[:, None])
        return seg, verdict

    @property
    def wants_hidden(self) -> bool | tuple:
        """The hidden states the drafter reads: False, or their indices (``hidden_of``'s, the last as -1)."""
        if not (self.drafter.needs_hidden or self.drafter.hidden_layers):
            return False
        return (*(self.drafter.hidden_layers or ()), -1)

    def hidden_of(self, out) -> tuple:
        """(last hidden state, the drafter's extra layers) of a forward, as the drafter asked."""
        if not self.wants_hidden:
            return None, None
        layers = self.drafter.hidden_layers
        return out.hidden_states[-1], tuple(out.hidden_states[i] for i in layers) if layers else None

    def _accept(self, batch: Batch, rows: dict[int, _Row], proposal: Proposal | None, verdict: Verdict) -> list[int]:
        """Append each row's accepted drafts and next token; returns accepted counts (host)."""
        bsz = len(batch.seqs)
        if proposal is not None and proposal.tokens.shape[1]:
            path_tokens = proposal.tokens.gather(1, verdict.path.clamp(min=0))
            emitted = torch.cat([path_tokens, verdict.next_token[:, None]], dim=1)
            if proposal.is_tree:
                drafted = (proposal.parents >= -1).sum(-1).tolist()
                depths = [proposal.max_depth] * bsz
            else:
                drafted = proposal.lengths.tolist() if proposal.lengths is not None else [proposal.tokens.shape[1]] * bsz
                depths = drafted
        else:
            emitted = verdict.next_token[:, None]
            drafted = depths = [0] * bsz
        host = torch.cat([verdict.accepted[:, None], emitted], dim=1).tolist()
        width = 1 + (proposal.tokens.shape[1] if proposal is not None else 0)
        accepted_counts = []
        for i, line in enumerate(host):
            a = line[0]
            row = rows[batch.rows[i]]
            row.target_calls += 1
            row.widths[width] = row.widths.get(width, 0) + 1
            row.drafted += drafted[i]
            row.accepted += a
            _count_positions(row, a, depths[i])
            self._append(row, batch.seqs[i], line[1 : 1 + a] + [line[-1]])
            accepted_counts.append(a)
        batch.root = verdict.next_token
        return accepted_counts

    def _append(self, row: _Row, seq: list[int], new: list[int]) -> None:
        if row.finish:
            return
        have = len(row.tokens)
        row.finish = append_tokens(row.tokens, new, row.max_new, self.eos_ids, self.stop, self.tokenizer)
        seq.extend(row.tokens[have:])
        if self.first_finish and row.finish == "stop" and row.group is not None:
            self._first_finish[row.group] = min(self._first_finish.get(row.group, len(row.tokens)), len(row.tokens))

    def _cancel_beaten(self, batch: Batch, rows: dict[int, _Row]) -> None:
        """First Finish Search: a sample still going once a sample of its group finished with as many
        tokens or fewer can no longer finish first; it stops ("cancelled"). Finishing first is counted in
        tokens, not wall time, so the winner does not depend on the drafter, the batch or the machine."""
        for i in batch.rows:
            row = rows[i]
            limit = self._first_finish.get(row.group)
            if limit is not None and not row.finish and len(row.tokens) >= limit:
                row.finish = "cancelled"

    def _drop_finished(self, batch: Batch, rows: dict[int, _Row], state: KVState, joining: int = 0) -> None:
        """Finished rows leave the batch, its state and the drafter; the ``joining`` rows that follow the
        batch's in the state stay. A row that stays keeps its place unless it is past the rows that
        stay: such a row takes the place of a finished one, so at most as many rows move as finished
        (the caches move rows in place)."""
        if self._first_finish:
            self._cancel_beaten(batch, rows)
        kept = [i for i, r in enumerate(batch.rows) if not rows[r].finish]
        if len(kept) == len(batch.rows):
            return
        self.drafter.retire([batch.seqs[i] for i, r in enumerate(batch.rows) if rows[r].finish])
        held = (state.cache_bytes(), self.drafter.cache_bytes())  # before the rows go: what the batch held at its largest
        for r in batch.rows:
            if rows[r].finish:
                rows[r].cache_bytes = held
        tail = iter(i for i in kept if i >= len(kept))
        keep = [i if not rows[batch.rows[i]].finish else next(tail) for i in range(len(kept))]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        active = len(batch.rows)
        batch.rows = [batch.rows[i] for i in keep]
        batch.groups = [batch.groups[i] for i in keep]
        batch.references = [batch.references[i] for i in keep]
        batch.keys = [batch.keys[i] for i in keep]
        batch.seqs = [batch.seqs[i] for i in keep]
        batch.root = batch.root[idx]
        if keep or joining:
            state.select_rows(torch.cat([idx, torch.arange(active, active + joining, device=self.device)]))
        if keep:
            self.drafter.select_rows(idx)

    def _joined(self, batch: Batch, state: KVState, joining: list[Joining], rows: dict[int, _Row], generator) -> Batch:
        """Joining rows whose prompts are complete become rows of the batch: their first token is drawn
        from their last prompt token's logits, and the drafter takes them as it takes a prefill
        (``admit``, or ``begin`` when the batch has no rows left). Returns the batch."""
        done = [k for k, j in enumerate(joining) if j.complete]
        active = len(batch.rows)
        if done != list(range(len(done))):  # the state's rows in the batch's order, then the joining
            later = [k for k in range(len(joining)) if k not in done]
            state.select_rows(torch.tensor(list(range(active)) + [active + k for k in done + later], device=self.device))
        joined = [joining[k] for k in done]
        joining[:] = [j for j in joining if not j.complete]
        keep_all = self.drafter.needs_prefill_logits
        seg = stack([j.pieces for j in joined], [j.request.prompt_ids for j in joined], self.device, keep_all)
        requests = [j.request for j in joined]
        new = self._new_batch(requests, [j.index for j in joined], seg.logits[:, -1:], rows, generator)
        if not batch.rows:
            self.drafter.begin(new, seg)
            batch = new
        else:
            self.drafter.admit(new, seg)
            self._merge(batch, new)
        self._drop_finished(batch, rows, state, len(joining))
        return batch

    def _finished(self, rows: dict[int, _Row]) -> Iterator[tuple[int, GenResult]]:
        done = [i for i, r in rows.items() if r.finish]
        now = time.perf_counter()
        for i in done:
            yield i, self._result(rows.pop(i), now)

    def _result(self, row: _Row, now: float) -> GenResult:
        stats = {
            "new_tokens": len(row.tokens),
            "target_calls": row.target_calls,
            "drafted_tokens": row.drafted,
            "accepted_tokens": row.accepted,
            "position_drafted": row.pos_drafted,
            "position_accepted": row.pos_accepted,
            "verify_widths": dict(sorted(row.widths.items())),
            "row_wall_s": round(now - row.start, 6),  # from its admission to its last token
            # the key/value memory of the row's batch when it finished (buffers grow, never shrink, within a batch)
            "target_cache_bytes": row.cache_bytes[0],
            "draft_cache_bytes": row.cache_bytes[1],
        }
        return GenResult(token_ids=row.tokens, finish_reason=row.finish or "length", stats=stats)


def _count_positions(row: _Row, accepted: int, drafted: int) -> None:
    """Per-position acceptance: position i counts when every earlier position was accepted."""
    reach = min(drafted, accepted + 1)
    while len(row.pos_drafted) < reach:
        row.pos_drafted.append(0)
        row.pos_accepted.append(0)
    for i in range(reach):
        row.pos_drafted[i] += 1
        if i < accepted:
            row.pos_accepted[i] += 1


def _join(head: Segment, tail: Segment, bsz: int, keep_all: bool) -> Segment:
    """The prefill segment of prompts that share ``head`` (one row, computed once): what drafters
    would have seen had every prompt been prefilled whole."""

    def rows(x):
        return None if x is None else x.expand(bsz, *x.shape[1:])

    def cat(a, b):
        return None if a is None or b is None else torch.cat([rows(a), b], 1)

    layers = None
    if tail.hidden_layers is not None:
        layers = tuple(cat(a, b) for a, b in zip(head.hidden_layers, tail.hidden_layers))
    logits = cat(head.logits, tail.logits) if keep_all else tail.logits
    return Segment(cat(head.input_ids, tail.input_ids), cat(head.input_valid, tail.input_valid), logits,
                   cat(head.hidden, tail.hidden), layers)
