"""models.head: the engine's output layer. Greedy rounds read it screened in fp16 and must still return
the float32 argmax at every position, near-ties included; sampling rounds get float32 logits; outside
the engine's scope the layer is untouched."""

import pytest
import torch

from specdec.models import head


def _linear(vocab=20000, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.05)
    return lin.requires_grad_(False)


class _Model(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lm_head = lin

    def get_output_embeddings(self):
        return self.lm_head


def test_the_screen_returns_the_float32_argmax_even_for_near_ties():
    lin = _linear()
    w = lin.weight
    # rows that differ from token 7's by less than fp16 can tell apart: fp16 logits tie, float32 ones do not
    with torch.no_grad():
        for j, delta in ((11, 1e-6), (12, -1e-6), (13, 3e-7), (19999, 2e-6)):
            w[j] = w[7] + delta * torch.sign(w[7])
    model = _Model(lin)
    fast = head.install(model)
    assert fast is not None and head.install(model) is fast
    g = torch.Generator().manual_seed(1)
    # hidden states along token 7's row make 7 and its near-copies the top of every row
    h = torch.randn(200, 64, generator=g) * 3 + 40 * w[7] / w[7].norm()
    ref = torch.nn.functional.linear(h, w)
    with head.scope(model, greedy=True):
        screened = torch.cat([lin(h[i : i + 8]) for i in range(0, 200, 8)])
    assert torch.equal(screened.argmax(-1), ref.argmax(-1))
    assert set(ref.argmax(-1).tolist()) - {7}, "the near-ties decide some rows"
    # the fp16 screen alone would get some of them wrong: the recomputation is what makes it exact
    fp16 = torch.nn.functional.linear(h, w.half().float())
    assert not torch.equal(fp16.argmax(-1), ref.argmax(-1))
    assert fast.screened == 200 and 200 <= fast.candidates < 200 * 8


@pytest.mark.parametrize("rows", [1, 3, 4, 12])
def test_sampling_rounds_get_float32_logits_and_outside_the_engine_the_layer_is_plain(rows):
    lin = _linear(seed=2)
    model = _Model(lin)
    head.install(model)
    h = torch.randn(rows, 64)
    ref = torch.nn.functional.linear(h, lin.weight)
    with head.scope(model, greedy=False):
        exact = lin(h)
    torch.testing.assert_close(exact, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin(h), ref)  # out of scope: nn.Linear's own forward


def test_small_vocabularies_and_other_dtypes_are_left_alone():
    assert head.install(_Model(_linear(vocab=1000))) is None
    assert head.install(_Model(_linear().double())) is None


@pytest.mark.parametrize("drafter", ["ar", "ngram"])
def test_greedy_decoding_with_the_screened_head_equals_generate(drafter):
    """A float32 target with a 20k vocabulary: the engine's rounds read the screened head (batched rows,
    verify forwards of several positions), and the text is generate's token for token."""
    from conftest import ByteTokenizer, make_prompts
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.decode.drafters.model_free import NgramDrafter
    from specdec.decode.drafters.base import NoDrafter
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=20000, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    fast = head.install(model)
    assert fast is not None
    prompts = [[t * 157 % 20000 for t in p] for p in make_prompts(3, seed=4)]
    engine = SpecEngine(model, ByteTokenizer(), NgramDrafter() if drafter == "ngram" else NoDrafter())
    got = engine.generate([GenRequest(p, 20) for p in prompts])
    for p, res in zip(prompts, got):
        ref = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=2, pad_token_id=0)
        assert res.token_ids == ref[0, len(p):].tolist()
    assert fast.screened > 0


@pytest.mark.parametrize("rows", [1, 5, 12])
def test_racing_returns_the_exact_argmax_of_logit_over_t_plus_noise(rows):
    """The race (verify.race_noise): screened or not, the returned scores' argmax is the argmax of the
    float32 logits / T + noise, and the layer says it added the noise."""
    from specdec.decode.engine.verify import race_noise, race_scores

    lin = _linear(seed=3)
    model = _Model(lin)
    fast = head.install(model)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(rows, 64, generator=g) * 4
    noise = race_noise(11, list(range(rows)), torch.zeros(rows, 1, dtype=torch.long), lin.out_features, "cpu")[:, 0]
    ref = race_scores(torch.nn.functional.linear(h, lin.weight), noise, 0.7)
    before = fast.screened
    with head.scope(model, greedy=False), head.racing(model, noise, 0.7) as raced:
        got = lin(h)
    assert raced["applied"]
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (fast.screened > before) == (rows <= head.SCREEN_UP_TO)  # few rows: screened in fp16
    # the noise decides: without it the argmax is another token in most rows
    assert (ref.argmax(-1) != torch.nn.functional.linear(h, lin.weight).argmax(-1)).any()


def test_race_noise_is_finite_even_where_the_uniform_draw_is_zero(monkeypatch):
    """torch.rand returns 0 once in 2^24 draws (a 262k vocabulary meets it every 64 positions); infinite
    noise there made every token a candidate of the screen."""
    from specdec.decode.engine import verify

    real = torch.rand
    monkeypatch.setattr(torch, "rand", lambda *a, **k: real(*a, **k).zero_())
    noise = verify.race_noise(0, [0], torch.zeros(1, 1, dtype=torch.long), 100, "cpu")
    assert torch.isfinite(noise).all()
