"""decode.engine.lean: the drafts' plain-function forward gives HF's logits and hidden states, or is not used."""

from __future__ import annotations

import torch
from conftest import ByteTokenizer, make_prompts, tiny_llama

from specdec.decode.engine.cache import KVState
from specdec.decode.drafters.draft_model import ModelDrafter
from specdec.decode.drafters.self_speculation import layer_skip_view
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.lean import lean_step
from specdec.decode.engine.types import GenRequest


def test_lean_forward_matches_hf_through_kvstate():
    model = tiny_llama(layers=2, heads=4, kv_heads=2).float()  # grouped-query attention, float32 as decoded
    lean, ref = KVState(model, 2, torch.device("cpu"), lean=True), KVState(model, 2, torch.device("cpu"))
    assert lean._lean is not None and ref._lean is None
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (2, 7), generator=gen)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :3] = False  # row 1 is left-padded
    segments = [(ids, valid, 7), (ids[:, :3], None, 1), (ids[:, 3:4], None, 1), (ids[:, 4:6], None, 2)]
    for seg, seg_valid, keep in segments:  # a prefill, a 3-token verify keeping one, then steps
        a = lean.forward(seg, seg_valid, hidden=True)
        b = ref.forward(seg, seg_valid, hidden=True)
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.hidden_states[-1], b.hidden_states[-1], rtol=1e-5, atol=1e-5)
        kv = torch.ones(2, keep, dtype=torch.bool) if seg_valid is None else seg_valid
        for state in (lean, ref):
            state.commit_prefix(keep, kv)
    assert lean.length == ref.length == 7 + 1 + 1 + 2


def test_lean_step_refuses_what_it_cannot_reproduce():
    biased = tiny_llama(layers=2).float()
    biased.config.attention_bias = True  # Qwen2-style q/k/v biases: another architecture
    assert lean_step(biased) is None
    step = lean_step(tiny_llama(layers=2, seed=1).float())
    assert step is not None and step.matches_hf()
    step.layers[0][2].mul_(1.001)  # its fused q/k/v copy drifts from the model's weights
    assert not step.matches_hf()
    model = tiny_llama(layers=2, seed=3).float()
    first = lean_step(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(0.5)  # weights written in place: the fused copies are rebuilt
    again = lean_step(model)
    assert again is not first and again.matches_hf()
    hooked = tiny_llama(layers=2, seed=2).float()
    hooked.model.layers[0].register_forward_hook(lambda *_: None)  # hooks run only through module calls
    assert lean_step(hooked) is None


def test_greedy_decoding_with_a_lean_draft_equals_plain_decoding():
    target = tiny_llama(layers=3, seed=0).float()
    draft = tiny_llama(layers=1, seed=5).float()
    assert lean_step(draft) is not None
    prompts = make_prompts(4, seed=3)
    reqs = [GenRequest(p, 24) for p in prompts]
    plain = SpecEngine(target, ByteTokenizer()).generate(reqs)
    for drafter in (ModelDrafter(draft), ModelDrafter(layer_skip_view(target, [1]))):
        out = SpecEngine(target, ByteTokenizer(), drafter, num_draft=3).generate(reqs)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
        assert drafter.state._lean is not None
