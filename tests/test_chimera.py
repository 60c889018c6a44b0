"""Chimera heads (trigram encoder + full-context decoder + residual decoding heads): training reduces the
loss, the drafter's incremental decoder state is the training-time one, sampling keeps the target's
distribution, and the CLI trains an artifact that decode uses. (Greedy == ar at batch sizes 1 and 3, static
and dynamic trees, and the reduced-vocabulary path run in tests/test_heads.py, parametrised over KINDS.)"""

from __future__ import annotations

import json

import torch
from conftest import ByteTokenizer, invoke, make_prompts, tiny_llama
from test_sampling import P_FLOOR, two_token_pvalue

from specdec.decode.drafters.heads import ChimeraDrafter
from specdec.decode.engine.loop import SpecEngine
from specdec.decode.engine.types import GenRequest
from specdec.decode.engine.verify import Sampling
from specdec.models.head_artifacts import build_heads


def _chimera(target, window=64, seed=0):
    """Chimera heads on ``target`` with every zero-initialised weight randomised (a fresh module is Medusa)."""
    torch.manual_seed(seed)
    heads = build_heads("chimera", target, {"num_heads": 3, "window": window}).attach(target).double().eval()
    with torch.no_grad():
        for p in heads.parameters():
            if p.dim() == 2 and not p.abs().sum():
                p.normal_(0, 0.3 / p.shape[1] ** 0.5)
        heads.fc.weight.add_(torch.randn_like(heads.fc.weight) * 0.1)
    return heads


def test_a_few_steps_reduce_the_loss_and_train_every_part(target):
    heads = build_heads("chimera", target, {"num_heads": 3, "window": 8}).attach(target).double()
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    ids = torch.tensor([p[:20] for p in make_prompts(4, seed=5, lo=20, hi=24)])
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss, parts = heads(hs, ids, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert set(parts) == {"ce0", "ce1", "ce2"}
    assert losses[-1] < 0.8 * losses[0], losses
    after = heads.state_dict()
    for name in ("trigram.weight", "fc.weight", "decoder.attn.q.weight", "decoder.attn.o.weight", "heads.2.0.linear.weight"):
        assert not torch.equal(before[name], after[name]), name


def test_the_drafters_incremental_state_is_the_training_time_one(target):
    """Every round, each row's head log-probs equal chain_logits on the row's whole text at its last
    committed position (the root its next token): through left-padded prompts, a window shorter than the
    text, rows finishing at different times and rows joining a running batch (continuous batching)."""
    heads = _chimera(target, window=6)
    seen = []

    class Spy(ChimeraDrafter):
        def _reset_tree(self, batch):
            super()._reset_tree(batch)
            seen.append(([list(s) for s in batch.seqs], self._logp.clone()))

    drafter = Spy(heads, target, tree="static", tree_tokens=8, top_k=2)
    prompts = make_prompts(5, seed=7, lo=3, hi=14)
    reqs = [GenRequest(p, n) for p, n in zip(prompts, [14, 5, 10, 3, 12])]
    engine = SpecEngine(target, ByteTokenizer(), drafter, eos_ids=[])
    got = [r for _, r in sorted(engine.stream(reqs, batch_size=3))]
    ar = SpecEngine(target, ByteTokenizer(), None, eos_ids=[]).generate(reqs)
    assert [r.token_ids for r in got] == [r.token_ids for r in ar]
    assert sum(r.stats["drafted_tokens"] for r in got) > 0
    checked = 0
    with torch.no_grad():
        for seqs, logp in seen:
            for row, seq in enumerate(seqs):
                ids = torch.tensor([seq])
                chain = heads.chain_logits(target(input_ids=ids, output_hidden_states=True).hidden_states, ids, 3)
                ref = torch.log_softmax(chain[:, 0, len(seq) - 2].float(), -1)
                assert torch.allclose(logp[:, row], ref, atol=1e-5), (len(seq), (logp[:, row] - ref).abs().max())
                checked += 1
    assert checked > 20 and max(len(s) for seqs, _ in seen for s in seqs) > 6 + 3


def test_sampling_keeps_the_target_joint_distribution():
    vocab = 12
    target = tiny_llama(vocab=vocab, hidden=32, layers=2, seed=3)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.25)  # undo most of the sharpening: many tokens matter
    drafter = ChimeraDrafter(_chimera(target, seed=1), target, tree="static", tree_tokens=6, top_k=2)
    prompt = [5, 7, 5, 7, 5]
    sampling = Sampling(temperature=0.8)
    engine = SpecEngine(target, ByteTokenizer(), drafter, sampling, num_draft=3, seed=123, eos_ids=[])
    res = engine.generate([GenRequest(prompt, 2) for _ in range(6000)])
    assert two_token_pvalue(res, target, prompt, sampling) > P_FLOOR
    assert sum(r.stats["accepted_tokens"] for r in res) > 0  # drafts were actually tested


def test_cli_trains_an_artifact_that_decode_uses_and_export_refuses(tiny_family, tmp_path):
    from specdec.tests.test_train import write_decode_output

    data = write_decode_output(tmp_path / "data.jsonl", n=60)
    out = tmp_path / "chimera"
    res = invoke(["train-heads", "--kind", "chimera", "--target", tiny_family / "target", "--data", data, "--out", out,
                  "--max-steps", "4", "--batch-size", "4", "--seq-len", "32", "--num-heads", "3"])
    assert res.exit_code == 0, res.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kind"] == "chimera" and cfg["num_heads"] == 3 and cfg["window"] == 64
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["kind"] == "chimera" and metrics["steps"] == 4 and len(metrics["top1_accuracy"]) == 3
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(["def f(x):\n", "import os\n", "for i in"])))
    completions = {}
    for name, drafter in (("ar", "ar"), ("chimera", out)):
        res = invoke(["decode", "--in", src, "--out", tmp_path / f"{name}.jsonl", "--target", tiny_family / "target", "--drafter", drafter,
                      "--max-new-tokens", "12", "--batch-size", "2"])
        assert res.exit_code == 0, res.output
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        completions[name] = [r["completion"] for r in rows]
        if name == "chimera":
            assert sum(r["stats"]["drafted_tokens"] for r in rows) > 0
    assert completions["chimera"] == completions["ar"]
    res = invoke(["export", out, "--to", "hf"])
    assert res.exit_code != 0 and "chimera" in res.output and "no public convention" in res.output
