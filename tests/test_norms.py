"""Gemma's RMSNorms in fewer operations (``models.norms``): routed only where they compute transformers'
floats bit for bit, so a target's logits and its greedy text do not change."""

import torch
from test_architectures import build

from specdec.models import norms


def _norms(model):
    return [m for m in model.modules() if type(m).__name__ in norms.NORM_CLASSES]


def test_every_gemma_norm_is_routed_and_the_logits_are_the_same_floats():
    model = build("gemma3").float()  # the zoo builds float64; a CPU target runs float32
    with torch.no_grad():  # norms' weights away from their zero init, as a trained model's are
        for m in _norms(model):
            m.weight.normal_(0, 0.5)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, model.config.vocab_size, (b, t), generator=g) for b, t in ((1, 1), (1, 7), (3, 5))]
    with torch.inference_mode():
        before = [model(x).logits for x in ids]
    assert norms.install(model) == len(_norms(model)) > 0
    with torch.inference_mode():
        after = [model(x).logits for x in ids]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_norm_written_in_place_is_read_anew():
    model = build("gemma3").float()  # the zoo builds float64; a CPU target runs float32
    norms.install(model)
    norm = _norms(model)[0]
    x = torch.randn(2, norm.weight.shape[0])
    with torch.no_grad():
        norm(x)
        norm.weight.add_(0.25)
        want = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)) * (1.0 + norm.weight)
    assert torch.equal(norm(x), want)


def test_a_forward_that_is_not_the_same_floats_is_not_routed(monkeypatch):
    """The probe decides: a shorter forward that rounds differently (its sum of squares taken in another
    order) is refused, and transformers' forward stays."""
    model = build("gemma3").float()  # the zoo builds float64; a CPU target runs float32
    real = torch.sum
    monkeypatch.setattr(torch, "sum", lambda t, *a, **k: real(t.flip(-1), *a, **k))
    assert norms.install(model) == 0
    monkeypatch.setattr(torch, "sum", real)
    assert all("forward" not in vars(m) for m in _norms(model))


def test_inputs_it_was_not_checked_for_go_to_transformers_forward():
    model = build("gemma3").float()  # the zoo builds float64; a CPU target runs float32
    norms.install(model)
    norm = _norms(model)[0]
    x = torch.randn(3, norm.weight.shape[0], dtype=torch.float64)
    assert norm(x).dtype == torch.float64  # transformers' forward casts back to the input's dtype
