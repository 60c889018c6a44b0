"""PEARL: the draft drafts the next block while the target verifies this one (post-verify), and
optionally the target tests the first draft while the draft draws the rest (pre-verify).

Plain speculative decoding alternates, and each model waits for the other: the target while the
draft drafts, the draft while the target verifies. ``ParallelDrafter.propose`` hands the engine a
block of drafts and starts a background thread in which the draft goes on as if the target will
accept all of them: first its guess of the token the target emits after the block, then drafts
after that guess. ``observe`` (the verdict is in) stops that thread and joins it. When every row
accepted the whole block and the target's token is the draft's guess, the drafts made meanwhile
are the next round's proposal, ready at no drafting time; otherwise they are rolled back.

Adaptive length: the thread drafts until the verdict is in (at most ``num_draft`` drafts after the
guess), so a block that follows a fully accepted one is as long as the draft gets while the target
verifies, and a rejected block costs at most the one draft step in flight when the verdict came.
As in PEARL, drafting ahead follows a fully accepted block only; after a rejection a round is plain.

Lossless: verification is exact for any proposal whose tokens were drawn from the q it reports. A
kept block was drafted on the very text the target produced (the guess is the target's token) and
reports the q each draft was drawn from; a rolled-back one is never shown to the target.
At T>0 the outcome for a seed depends on timing (how many drafts the thread made); its distribution
does not.

Threads: the draft's KV cache is touched by one thread at a time. The background thread owns it
from the end of ``propose`` to the join in ``observe``, and every other step joins first. The
thread draws from the drafter's own generator (torch generators are not thread-safe, and
verification draws from the engine's meanwhile) and runs under inference mode of its own (a
thread-local mode). An exception in the thread is raised again by the join. On a CPU the two
threads overlap inside torch ops only (they release the GIL; the Python around them does not), so
models whose forward is mostly Python overhead gain little; while both run, each has half the
process's intra-op threads. On CUDA the draft runs on a stream of its own.

Pre-verify (``pre_verify``): a block the draft must draft in the loop's thread (no kept block is
ready) is handed to the engine after its first draft d1, with ``Proposal.rest``; the background thread
draws d2..dK (and then, drafting ahead, the guess and the drafts after it) while the target's forward
over the root alone tests d1 (``SpecEngine._verify_split``). When every row rejects d1 the round ends
there and the thread's drafts are rolled back; otherwise ``rest`` waits for the block and a second
target forward tests d2..dK. A round whose d1 is accepted costs the target two forwards instead of
one; one whose d1 is rejected costs a one-token forward and no waiting for the draft; and the draft
reaches its guess only after the block, so blocks drafted ahead are shorter. Off by default: where a
forward's cost is mostly fixed (small models, a CPU) the second forward costs more than the rejected
rounds save.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.base import Proposal, Segment, draw
from specdec.decode.engine.length import LengthPolicy
from specdec.decode.engine.verify import Sampling


class ParallelDrafter(ModelDrafter):
    length_policy = LengthPolicy.own  # it decides each round's length itself
    records = False  # its steps run in its own thread while the loop's thread records the target's

    def __init__(self, model, adaptive: bool = True, pre_verify: bool = False):
        """adaptive False: the thread runs every round and always drafts the guess and ``num_draft``
        drafts (and with pre-verify the block's drafts after the first), verdict or not (the main
        thread then waits for it): runs that a seed reproduces exactly at T>0. pre_verify: see the
        module's docstring."""
        super().__init__(model)
        self.adaptive = adaptive
        self.pre_verify = pre_verify
        self.cut_rounds = 0  # pre-verified rounds that ended at the first draft (every row rejected it)
        self._ahead_next = not adaptive  # draft ahead in the next round (see ``observe``)
        self.generator: torch.Generator | None = None
        self.ready_rounds = 0  # proposals drafted while the target verified the block before
        self._stream = None
        self._thread: threading.Thread | None = None
        self._threads = 0  # the intra-op threads to restore when the thread is joined (CPU)
        self._verdict_in = threading.Event()
        self._ahead: tuple[int, list, list] | None = None  # the thread's (steps fed, tokens, q's)
        self._error: BaseException | None = None
        self._ready: Proposal | None = None  # a kept block: the next proposal; the cache holds all but its last draft
        self._proposed = 0  # drafts in this round's block (0: no proposal)
        self._block = 0  # of them, drafted by the thread (pre-verify: all but the first)
        self._block_done = threading.Event()  # the thread has drawn them (or stopped)
        self._whole = False  # the engine asked for the whole block (``Proposal.rest``)

    # -- the drafter protocol --------------------------------------------------------------------

    def begin(self, batch, seg: Segment) -> None:
        self._abandon()
        self._stream = torch.cuda.Stream(batch.device) if batch.device.type == "cuda" else None
        seed = int(torch.randint(1 << 62, (1,), generator=batch.generator, device=batch.device).item())
        self.generator = torch.Generator(device=batch.device).manual_seed(seed)
        self._ready, self._proposed = None, 0
        self._ahead_next = not self.adaptive
        with self._draft_stream():
            super().begin(batch, seg)

    def propose(self, batch) -> Proposal | None:
        self._join()
        k = batch.num_draft
        self._block, self._whole = 0, False
        with self._draft_stream():
            if self._ready is not None and self._ready.tokens.shape[1] <= k:
                proposal, self._ready = self._ready, None
                self.ready_rounds += 1
            else:
                self._discard_ready()
                self._block = k - 1 if self.pre_verify and k > 1 else 0
                proposal = self._propose_fixed(batch, k - self._block)
        if proposal is None:
            return None
        self._proposed = proposal.tokens.shape[1] + self._block
        self._hand_over(proposal)
        ahead = k + 1 if self._ahead_next else 0  # the guess and up to k drafts after it
        if self._block or ahead:
            self._start(proposal.tokens[:, -1], batch.sampling, self._block + ahead)
        else:
            self._ahead = (0, [], [])
        if self._block:
            proposal.rest = functools.partial(self._whole_block, proposal)
        return proposal

    def observe(self, batch, seg: Segment) -> None:
        if not self._proposed:  # the engine drafted nothing this round: a kept block no longer follows the text
            with self._draft_stream():
                self._discard_ready()
            return
        self._verdict_in.set()
        self._join()
        steps, tokens, probs = self._ahead
        n, b = self._proposed, self._block
        self._ahead, self._proposed = None, 0
        self.cut_rounds += bool(b) and not self._whole
        ahead = steps - b  # the thread's steps past the block: the guess, then drafts after it
        accepted = seg.accepted
        # PEARL's switch: the draft drafts ahead after a round whose whole block was accepted; after a
        # rejection, work ahead would most likely be thrown away and only slow the target down
        self._ahead_next = not self.adaptive or all(a == n for a in accepted)
        kept = ahead >= 1 and all(a == n for a in accepted)
        # the guess is compared to the target's token only when every draft was accepted (a host read)
        kept = kept and torch.equal(tokens[b], batch.root)
        with self._draft_stream():
            if kept:
                # cache: the block's drafts d1..dn, the guess (the target's token), then the drafts after it
                self.fed = [f + n - 1 + min(ahead, 2) for f in self.fed]
                self._drafted = max(ahead - 2, 0)
                self._ready = block_after_guess(tokens[b:], probs[b:])
            else:
                slots = n - 1 - b + steps  # drafts fed in the loop's thread, then the thread's
                real = min(slots, n)  # slots holding the block's drafts; the rest are speculative
                keep = [min(a, real) for a in accepted]
                self.state.rollback(slots, keep)
                self.fed = [f + kp for f, kp in zip(self.fed, keep)]
                self._drafted = 0

    def select_rows(self, rows: torch.Tensor) -> None:
        self._join()
        with self._draft_stream():
            super().select_rows(rows)
            if self._ready is not None:
                probs = self._ready.draft_probs
                self._ready = Proposal(tokens=self._ready.tokens[rows], draft_probs=None if probs is None else probs[rows])

    def admit(self, batch, seg: Segment) -> None:
        self._join()
        with self._draft_stream():
            self._discard_ready()  # the new rows have no block drafted ahead
            super().admit(batch, seg)

    # -- drafting --------------------------------------------------------------------------------

    def _pick(self, logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._sample(logits, batch.sampling)

    def _sample(self, logits: torch.Tensor, sampling: Sampling) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draw(logits, sampling, self.generator)  # the drafter's own generator, in either thread

    def _discard_ready(self) -> None:
        """Roll back a kept block's drafts (the cache holds all but its last)."""
        if self._ready is not None:
            self.state.rollback(self._drafted, [0] * len(self.fed))
            self._drafted = 0
            self._ready = None

    def _start(self, last: torch.Tensor, sampling: Sampling, limit: int) -> None:
        self._verdict_in.clear()
        self._block_done.clear()
        self._ahead, self._error = (0, [], []), None
        if self._stream is None:
            # on a CPU the two threads share the cores: each gets half the intra-op threads while both
            # run (more threads than cores spin against each other in every op's barrier)
            self._threads = torch.get_num_threads()
            torch.set_num_threads(max(1, self._threads // 2))  # this thread's, and the new thread's
        self._thread = threading.Thread(target=self._draft_ahead, args=(last, sampling, limit), daemon=True)
        self._thread.start()

    def _draft_ahead(self, last: torch.Tensor, sampling: Sampling, limit: int) -> None:
        """Background: feed the last draft handed over, draw the block's remaining drafts (pre-verify),
        then the guess of the target's token and drafts after it, ``limit`` tokens in all; stop early
        once the verdict is in (adaptive)."""
        try:
            stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
            with torch.inference_mode(), stream:
                tok, tokens, probs = last, [], []
                one = torch.ones(last.shape[0], 1, dtype=torch.bool, device=last.device)
                while len(tokens) < limit and not (self.adaptive and self._verdict_in.is_set()):
                    out = self.state.forward(tok[:, None])
                    self.state.commit_prefix(1, one)
                    tok, q = self._sample(out.logits[:, -1], sampling)
                    tokens.append(tok)
                    probs.append(q)
                    if self._stream is not None:
                        self._stream.synchronize()  # so the verdict check sees how far the draft really got
                    self._ahead = (len(tokens), tokens, probs)
                    if len(tokens) == self._block:
                        self._block_done.set()
        except BaseException as exc:  # raised again by the join, in the decode loop's thread
            self._error = exc
        finally:
            self._block_done.set()  # a thread stopped by the verdict or by a failure wakes ``_whole_block``

    def _whole_block(self, first: Proposal) -> Proposal:
        """``Proposal.rest`` of a pre-verified round: the first draft and the ones the thread drew after
        it, once it has. The thread synchronised its stream before publishing them, and ``_ahead`` keeps
        them alive until ``observe``."""
        self._block_done.wait()
        if self._error is not None:
            self._join()  # raises it
        _, tokens, probs = self._ahead
        b = self._block
        block = Proposal(
            tokens=torch.cat([first.tokens, torch.stack(tokens[:b], 1)], 1),
            draft_probs=None if first.draft_probs is None else torch.cat([first.draft_probs, torch.stack(probs[:b], 1)], 1),
        )
        self._whole = True
        return block

    def _join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._verdict_in.set()
        thread.join()
        if self._threads:
            torch.set_num_threads(self._threads)
            self._threads = 0
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the parallel draft failed while the target verified") from error

    def _abandon(self) -> None:
        """Join a thread left by a decode that stopped mid-round; its work and any error go with the old batch."""
        try:
            self._join()
        except RuntimeError:
            pass

    # -- CUDA streams ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _draft_stream(self):
        """Draft work issued from the decode loop's thread runs on the draft's stream too, so the draft's
        cache is only ever written on that one stream; the streams wait for each other at both ends."""
        if self._stream is None:
            yield
            return
        main = torch.cuda.current_stream(self._stream.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            yield
        main.wait_stream(self._stream)

    def _hand_over(self, proposal: Proposal) -> None:
        """The proposal's tensors were made on the draft's stream and are read on the main one: the
        allocator must not give their memory to the draft's stream before the main stream is done."""
        if self._stream is None:
            return
        main = torch.cuda.current_stream(self._stream.device)
        for t in (proposal.tokens, proposal.draft_probs):
            if t is not None:
                t.record_stream(main)


def block_after_guess(tokens: list, probs: list) -> Proposal | None:
    """The next proposal from what the thread drew: the drafts after the guess (the guess itself is the
    target's token now, not a draft), each with the q it was drawn from. None when the thread stopped
    at the guess."""
    if len(tokens) < 2:
        return None
    return Proposal(tokens=torch.stack(tokens[1:], 1), draft_probs=None if probs[1] is None else torch.stack(probs[1:], 1))
