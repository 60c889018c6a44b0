"""The drafter contract: what a drafter declares on ``decode.drafters.base.Drafter`` is what its
proposals hold, greedy and sampled, in static and continuous batches."""

from __future__ import annotations

import pytest
from conftest import ByteTokenizer, make_prompts

from specdec.decode.drafters.aded import AdedDrafter
from specdec.decode.drafters.base import Drafter, NoDrafter
from specdec.decode.drafters.copying import CopyDrafter, InputCopyDrafter
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.model_free import NgramDrafter, RecycleDrafter
from specdec.decode.drafters.pearl import ParallelDrafter
from specdec.decode.drafters.self_speculation import SwiftDrafter
from specdec.decode.drafters.stand import StandDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest, Scheme
from specdec.decode.engine.verify import Sampling


def _drafters(target, draft_model):
    from test_heads import _heads  # a randomly initialised head set of each kind

    from specdec.decode.drafters.heads import DRAFTERS

    return {
        "ar": NoDrafter,
        "ngram": NgramDrafter,
        "recycle": RecycleDrafter,
        "copy": CopyDrafter,
        "input-copy": InputCopyDrafter,
        "aded": AdedDrafter,
        "stand": StandDrafter,
        "draft": lambda: ModelDrafter(draft_model),
        "draft-rsd": lambda: ModelDrafter(draft_model, scheme=Scheme.rsd, width=2),
        "draft-spectr": lambda: ModelDrafter(draft_model, scheme="spectr", width=2),
        "pearl": lambda: ParallelDrafter(draft_model, pre_verify=True),
        "swift": lambda: SwiftDrafter(target, seed=0, start=[1]),
        "medusa": lambda: DRAFTERS["medusa"](_heads("medusa", target), target, tree_tokens=8),
        "eagle": lambda: DRAFTERS["eagle"](_heads("eagle", target), target, tree="dynamic", tree_tokens=8, top_k=2),
    }


NAMES = ["ar", "ngram", "recycle", "copy", "input-copy", "aded", "stand", "draft", "draft-rsd", "draft-spectr", "pearl", "swift",
         "medusa", "eagle"]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", NAMES)
def test_proposals_hold_what_the_drafter_declares(target, draft_model, name, temperature):
    drafter = _drafters(target, draft_model)[name]()
    assert isinstance(drafter, Drafter)
    seen = []
    propose = drafter.propose

    def checked(batch):
        proposal = propose(batch)
        if proposal is not None:
            seen.append(proposal)
            assert not proposal.is_tree or drafter.proposes_trees, "a tree from a drafter that declares chains"
            assert proposal.draft_probs is None or drafter.has_draft_probs, "draft_probs from a drafter that declares none"
            assert proposal.rest is None or drafter.pre_verify, "a split proposal from a drafter that declares no pre-verify"
            if proposal.is_tree and drafter.tree_tokens is not None:
                assert proposal.tokens.shape[1] <= drafter.tree_tokens
        return proposal

    drafter.propose = checked
    engine = SpecEngine(target, ByteTokenizer(), drafter, Sampling(temperature), seed=3, eos_ids=[])
    requests = [GenRequest(p * 2, 12) for p in make_prompts(3, seed=7)]  # repeated text: the copying drafters find it
    if drafter.admits:
        list(engine.stream(iter(requests), batch_size=2))  # rows join a running batch
    else:
        engine.generate(requests)
    assert seen or name == "ar" or (name == "copy" and temperature > 0)  # sampled text rarely repeats the prompt
    if name in ("draft", "draft-rsd", "draft-spectr"):
        assert drafter.proposes_trees == (drafter.scheme != Scheme.standard)
