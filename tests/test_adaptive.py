"""SpecDec++ adaptive drafting: exactness against AR and independent per-row lengths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdec.decode.adaptive import FEATURES, N_STATS, AdaptiveDrafter, acceptance_features, build_adaptive
from specdec.decode.engine import SpecEngine
from specdec.decode.types import GenRequest
from specdec.decode.verify import Sampling
from specdec.tests.conftest import ByteTokenizer, make_prompts, tiny_llama
from specdec.train.acceptance import AcceptanceHead


def _head(hidden: int, seed: int = 3):
    torch.manual_seed(seed)
    head = AcceptanceHead(hidden + N_STATS).double()
    with torch.no_grad():
        # a head whose confidence varies with the hidden state, so rows stop at different steps
        head.out.weight.normal_(0, 0.3)
        head.out.weight[:, -N_STATS:] = 0.0  # the q statistics of a random draft say little; keep the spread from h
        head.out.bias.fill_(2.0)
    return head.eval()


class Recording(AdaptiveDrafter):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[list[int]] = []
        self.calls: list[int] = []  # draft forwards per round, the pending feed included
        self._forwards = 0
        self.model.register_forward_hook(lambda *_: setattr(self, "_forwards", self._forwards + 1))

    def propose(self, batch):
        before = self._forwards
        prop = super().propose(batch)
        if prop is not None:
            self.seen.append(prop.lengths.tolist())
            self.calls.append(self._forwards - before)
        return prop


def _generate(target, drafter, prompts, max_new=24, sampling=None, seed=0):
    reqs = [GenRequest(prompt_ids=p, max_new_tokens=max_new) for p in prompts]
    return SpecEngine(target, ByteTokenizer(), drafter, sampling=sampling, seed=seed).generate(reqs)


@pytest.mark.parametrize("bs", [1, 3])
def test_adaptive_greedy_equals_ar(target, draft_model, bs):
    prompts = make_prompts(bs, seed=bs)
    ar = _generate(target, None, prompts)
    drafter = Recording(draft_model, _head(draft_model.config.hidden_size), stop_threshold=0.7, min_draft=2, max_draft=8)
    out = _generate(target, drafter, prompts)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    lengths = [x for round_ in drafter.seen for x in round_]
    assert all(2 <= x <= 8 for x in lengths)
    assert len(set(lengths)) > 1  # the head makes rounds stop at different lengths
    if bs > 1:
        assert any(len(set(r)) > 1 for r in drafter.seen)  # rows stop independently within a round


def test_adaptive_sampling_runs(target, draft_model):
    prompts = make_prompts(2, seed=7)
    drafter = AdaptiveDrafter(draft_model, _head(draft_model.config.hidden_size), max_draft=6)
    out = _generate(target, drafter, prompts, sampling=Sampling(temperature=0.8), max_new=16)
    assert all(len(r.token_ids) == 16 or r.finish_reason == "stop" for r in out)


def test_build_adaptive_checks(tmp_path, draft_model):
    from safetensors.torch import save_file

    from specdec.decode.artifacts import SpecdecError, write_json

    head = _head(draft_model.config.hidden_size)
    save_file({k: v.float().contiguous() for k, v in head.state_dict().items()}, str(tmp_path / "model.safetensors"))
    fp = {"vocab_size": 5, "tokenizer_hash": "abc"}
    hidden = draft_model.config.hidden_size
    config = {"kind": "acceptance", "target": fp, "hidden_size": hidden, "features": FEATURES, "input_size": hidden + N_STATS, "num_layers": 3}
    write_json(tmp_path / "config.json", config)
    opts = SimpleNamespace(stop_threshold=0.2, min_draft=3, max_draft=9)
    drafter = build_adaptive(tmp_path, draft_model, opts)
    assert drafter.max_draft == 9 and drafter.default_k == 9 and drafter.stop_threshold == 0.2

    class Tok:
        def get_vocab(self):
            return {"x": 0, "y": 1}

    with pytest.raises(SpecdecError, match="another tokenizer"):
        build_adaptive(tmp_path, draft_model, opts, tokenizer=Tok())
    with pytest.raises(SpecdecError, match="hidden size"):
        build_adaptive(tmp_path, tiny_llama(hidden=64, layers=1), opts)

    write_json(tmp_path / "config.json", {k: v for k, v in config.items() if k not in ("features", "input_size")})
    with pytest.raises(SpecdecError, match="older format"):
        build_adaptive(tmp_path, draft_model, opts)


def test_head_judges_each_token_from_the_state_that_proposed_it(target, draft_model):
    """The head's input for draft token i is acceptance_features of the draft's forward over the text
    and drafts 1..i-1 (what training computes from one causal forward), and a stopping round feeds
    no token beyond its last draft."""
    seen = []

    class Spy(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.head = head

        def forward(self, x):
            seen.append(x.clone())
            return self.head(x)

    prompt = make_prompts(1, seed=5)[0]
    drafter = Recording(draft_model, Spy(_head(draft_model.config.hidden_size)), stop_threshold=0.5, min_draft=1, max_draft=6)
    root = _generate(target, None, [prompt], max_new=1)[0].token_ids[0]  # the draft starts after the target's token
    _generate(target, drafter, [prompt], max_new=8)
    k = drafter.seen[0][0]
    assert 1 <= k < 6 and drafter.calls[0] == k  # the pending feed + k-1 drafts fed: none after the stop
    # rebuild the round by hand: the prompt, then greedy drafts of the draft model
    ids = torch.tensor([prompt + [root]])
    with torch.no_grad():
        for i in range(k):
            out = draft_model(input_ids=ids, output_hidden_states=True)
            tok = out.logits[:, -1].argmax(-1)
            ref = acceptance_features(out.hidden_states[-1][:, -1], out.logits[:, -1], tok).double()
            assert torch.allclose(seen[i], ref, atol=1e-6)
            ids = torch.cat([ids, tok[:, None]], 1)
