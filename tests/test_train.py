"""train/loop.py, train/data.py, train/trainers/draft.py, train/trainers/acceptance.py on tiny random models."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import invoke
import torch

from specdec.models.artifacts import SpecdecError, UsageError, tokenizer_fingerprint
from specdec.train.loop import TrainConfig, config_from_dict, load_config, run_training

WORDS = "the a cat dog sat on mat ran far near big small red blue tree house went to and then it was".split()


def corpus(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))) + "." for _ in range(n)]


def make_tokenizer(vocab_size: int = 96, seed: int = 0):
    """A small BPE tokenizer trained here (no hub): byte alphabet restricted to ASCII letters."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False)
    tok.train_from_iterator(corpus(300, seed), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_target_dir(path: Path, vocab_size: int = 96, hidden: int = 48, layers: int = 2, seed: int = 0, tok_seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer(vocab_size, tok_seed)
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked random distributions: KD has something to learn
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_decode_output(path: Path, n: int = 120, seed: int = 0) -> Path:
    """What `specdec decode` writes: prompt + completion records, with an error record mixed in."""
    texts = corpus(n, seed)
    with open(path, "w") as fh:
        for i, t in enumerate(texts):
            half = len(t) // 2
            fh.write(json.dumps({"id": str(i), "prompt": t[:half], "completion": t[half:]}) + "\n")
            if i == 3:
                fh.write(json.dumps({"id": "bad", "line": 5, "error": "malformed JSON"}) + "\n")
    return path


def tiny_cfg(**kw) -> TrainConfig:
    base = dict(lr=3e-3, steps=6, batch=4, seq_len=32, warmup=1, checkpoint_every=0, progress=False, log_every=1, heldout=0.15)
    base.update(kw)
    return config_from_dict(base)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    make_target_dir(root / "target")
    write_decode_output(root / "data.jsonl")
    return root


# ---------------------------------------------------------------------------------------------
# config and data


def test_config_yaml_unknown_key_and_overrides(tmp_path):
    (tmp_path / "r.yaml").write_text("lr: 0.01\nsteps: 5\nextra: {kd_weight: 0.5}\n")
    cfg = load_config(tmp_path / "r.yaml", {"steps": 7, "batch": None})
    assert cfg.lr == 0.01 and cfg.steps == 7 and cfg.batch == 8 and cfg.extra["kd_weight"] == 0.5
    (tmp_path / "bad.yaml").write_text("lr: 0.01\nlearning_rate: 3\n")
    with pytest.raises(UsageError, match="learning_rate"):
        load_config(tmp_path / "bad.yaml")


def test_recipes_load():
    root = Path(__file__).resolve().parents[1] / "recipes"
    for name, sections in (("draft.yaml", ["draft", "acceptance"]), ("heads.yaml", ["medusa", "clover", "eagle"])):
        text = (root / name).read_text()
        assert text.startswith("# specdec ") or "specdec train-" in text.splitlines()[0]
        for s in sections:
            load_config(root / name, section=s)


def test_load_texts_formats(tmp_path):
    from specdec.train.data import load_texts, tokenize_blocks

    write_decode_output(tmp_path / "d.jsonl", n=5)
    (tmp_path / "t.txt").write_text("plain text document\nsecond line\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["from parquet one", "from parquet two"]}), tmp_path / "p.parquet")
    texts = load_texts([tmp_path / "d.jsonl", tmp_path / "t.txt", tmp_path / "p.parquet"])
    assert len(texts) == 5 + 1 + 2  # the error record is skipped
    assert texts[0] == corpus(5)[0]
    train, held = tokenize_blocks(texts * 20, make_tokenizer(), seq_len=16, heldout=0.2)
    assert train[0]["input_ids"].shape == (16,) and len(held) >= 1
    with pytest.raises(SpecdecError):
        load_texts([tmp_path / "missing.jsonl"])


# ---------------------------------------------------------------------------------------------
# the loop


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.lin(x).squeeze(-1)


class _ToyData:
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


def _toy_loss(model, batch):
    return ((model(batch["x"]).float() - batch["y"]) ** 2).mean()


class _Crash(Exception):
    pass


def test_resume_reproduces_loss_curve(tmp_path):
    # 4 micro-batches per epoch with grad_accum 2: the crash falls mid-epoch, resume must skip exactly
    cfg = tiny_cfg(steps=8, batch=5, grad_accum=2, checkpoint_every=3, lr=0.05, mixed_precision="no")
    full = run_training(cfg, _Toy(), _toy_loss, _ToyData(), tmp_path / "full")
    calls = {"n": 0}

    def crashing(model, batch):
        calls["n"] += 1
        if calls["n"] == 2 * 5 + 1:  # during optimizer step 6, after the step-3 checkpoint
            raise _Crash()
        return _toy_loss(model, batch)

    with pytest.raises(_Crash):
        run_training(cfg, _Toy(), crashing, _ToyData(), tmp_path / "split")
    resumed = run_training(cfg, _Toy(), _toy_loss, _ToyData(), tmp_path / "split", resume=True)
    assert len(resumed.losses) == len(full.losses) == 8
    assert resumed.losses == pytest.approx(full.losses, rel=1e-6, abs=1e-7)
    assert torch.allclose(resumed.model.lin.weight, full.model.lin.weight, atol=1e-6)


def test_budget_stops(tmp_path):
    cfg = tiny_cfg(steps=10_000, batch=5, budget_minutes=1e-4, mixed_precision="no")
    res = run_training(cfg, _Toy(), _toy_loss, _ToyData(), tmp_path / "b")
    assert res.stopped == "budget" and res.steps < 10_000


# ---------------------------------------------------------------------------------------------
# draft


def test_kd_loss_falls_and_artifact(workdir):
    from specdec.models.loading import load_draft
    from specdec.train.trainers.draft import train_draft

    out = workdir / "draft"
    m = train_draft(workdir / "target", [workdir / "data.jsonl"], out, tiny_cfg(steps=10), arch="layers=1,hidden=32,heads=4", kd_weight=1.0)
    curve = m["loss_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["specdec_kind"] == "draft"
    from transformers import AutoTokenizer

    assert cfg["specdec_target"] == tokenizer_fingerprint(AutoTokenizer.from_pretrained(workdir / "target"))
    for f in ("model.safetensors", "metrics.json", "training_config.yaml", "tokenizer.json"):
        assert (out / f).exists()
    assert set(m["expected_tau"]) == {str(k) for k in range(1, 9)}
    assert 1.0 <= m["expected_tau"]["1"] <= m["expected_tau"]["8"] <= 9.0
    assert load_draft(out).config.vocab_size == cfg["vocab_size"]


def test_kd_loss_terms_on_a_hand_built_example():
    import torch.nn.functional as F

    from specdec.train.trainers.draft import kd_loss

    torch.manual_seed(0)
    s, t = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    log_q, log_p = F.log_softmax(s, -1), F.log_softmax(t, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    ce_data = -log_q[:, :-1].gather(-1, ids[:, 1:, None]).mean()
    ce_target = -log_q.gather(-1, t.argmax(-1, keepdim=True)).mean()  # every position, the last included
    loss, parts = kd_loss(s, ids, t, 0.25, 1.0)
    assert float(loss) == pytest.approx(float(0.25 * kl + 0.75 * ce_data), rel=1e-5)
    assert parts["kl"] == pytest.approx(float(kl), rel=1e-5)
    loss, _ = kd_loss(s, ids, t, 0.25, 1.0, ce_labels="target")
    assert float(loss) == pytest.approx(float(0.25 * kl + 0.75 * ce_target), rel=1e-5)
    # the sparse (cached) teacher: top-k support, renormalised; its greedy labels are the first index
    values, indices = t.topk(3, dim=-1)
    log_p3 = F.log_softmax(values, -1)
    kl3 = (log_p3.exp() * (log_p3 - log_q.gather(-1, indices))).sum(-1).mean()
    loss, _ = kd_loss(s, ids, (values, indices.int()), 0.25, 1.0, ce_labels="target")
    assert float(loss) == pytest.approx(float(0.25 * kl3 + 0.75 * ce_target), rel=1e-5)
    # at T != 1 the KL runs on tempered distributions (times T^2) and the CE on plain ones
    log_q2, log_p2 = F.log_softmax(s / 2, -1), F.log_softmax(t / 2, -1)
    kl2 = (log_p2.exp() * (log_p2 - log_q2)).sum(-1).mean() * 4
    loss, _ = kd_loss(s, ids, t, 0.25, 2.0)
    assert float(loss) == pytest.approx(float(0.25 * kl2 + 0.75 * ce_data), rel=1e-5)


def test_ce_only_cached_teacher_and_lora(workdir):
    from specdec.models.loading import load_draft
    from specdec.train.trainers.draft import train_draft

    base = workdir / "draft-base"
    train_draft(workdir / "target", [workdir / "data.jsonl"], base, tiny_cfg(steps=2), arch="layers=1,hidden=32,heads=4", kd_weight=0.0)
    m = train_draft(workdir / "target", [workdir / "data.jsonl"], workdir / "draft-cached", tiny_cfg(steps=3), init=base,
                    kd_weight=0.5, cache_teacher=True, teacher_topk=16, ce_labels="target")
    assert m["teacher"] == "cached-top16" and (workdir / "draft-cached" / "teacher_cache.safetensors").exists()
    assert m["ce_labels"] == "target" and m["teacher_cache_s"] > 0
    m = train_draft(workdir / "target", [workdir / "data.jsonl"], workdir / "draft-lora", tiny_cfg(steps=3), init=base,
                    lora=True, lora_save="adapter")
    assert (workdir / "draft-lora" / "adapter_config.json").exists()
    assert load_draft(workdir / "draft-lora").config.hidden_size == 32


def test_draft_for_other_tokenizer_refused(workdir, tmp_path):
    from specdec.models.artifacts import check_fingerprint, read_config
    from specdec.train.trainers.draft import train_draft

    other = make_target_dir(tmp_path / "other", vocab_size=80, tok_seed=1)
    draft_cfg = read_config(workdir / "draft") if (workdir / "draft").exists() else None
    if draft_cfg is None:
        pytest.skip("needs the draft from test_kd_loss_falls_and_artifact")
    from transformers import AutoTokenizer

    with pytest.raises(SpecdecError, match="another tokenizer"):
        check_fingerprint(draft_cfg["specdec_target"], tokenizer_fingerprint(AutoTokenizer.from_pretrained(other)), "draft")
    with pytest.raises(SpecdecError, match="another tokenizer"):
        train_draft(other, [workdir / "data.jsonl"], tmp_path / "x", tiny_cfg(steps=1), init=workdir / "draft")
    with pytest.raises(SpecdecError, match="another tokenizer"):
        from specdec.train.trainers.acceptance import train_acceptance

        train_acceptance(other, workdir / "draft", [workdir / "data.jsonl"], tmp_path / "y", tiny_cfg(steps=1))


# ---------------------------------------------------------------------------------------------
# acceptance head


def test_acceptance_labels_hand_built():
    from specdec.train.trainers.acceptance_labels import acceptance_labels
    from specdec.train.trainers.acceptance import weighted_bce

    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.25, 0.6, 0.15], [0.5, 0.5, 0.0]])
    tokens = torch.tensor([[0, 1], [2, 0]])  # per row of (p, q): judge these tokens
    labels = acceptance_labels(p[:, None].expand(2, 2, 3), q[:, None].expand(2, 2, 3), tokens)
    # row 0: p/q = 2 -> 1 ; 0.3/0.6 = 0.5.  row 1: q(2) = 0 (a target-chosen token) -> 1 ; 0.1/0.5 = 0.2
    assert labels.flatten().tolist() == pytest.approx([1.0, 0.5, 1.0, 0.2])
    # a rejected-leaning label costs more with the reject class up-weighted
    z = torch.zeros(1)
    assert float(weighted_bce(z, torch.tensor([0.0]), 6.0)) == pytest.approx(6 * 0.6931, rel=1e-3)
    assert float(weighted_bce(z, torch.tensor([1.0]), 6.0)) == pytest.approx(0.6931, rel=1e-3)


def test_acceptance_features_from_one_causal_forward_match_incremental(draft_model):
    """Training labels every position from one forward; decoding sees one prefix at a time."""
    from specdec.models.acceptance import N_STATS, acceptance_features

    ids = torch.randint(3, 90, (2, 7))
    tokens = torch.randint(3, 90, (2, 6))  # tokens[:, j-1] is proposed after ids[:, :j]
    with torch.no_grad():
        out = draft_model(input_ids=ids, output_hidden_states=True)
        feats = acceptance_features(out.hidden_states[-1][:, :-1], out.logits[:, :-1], tokens)
        assert feats.shape == (2, 6, draft_model.config.hidden_size + N_STATS)
        for j in (1, 4, 6):
            o = draft_model(input_ids=ids[:, :j], output_hidden_states=True)
            ref = acceptance_features(o.hidden_states[-1][:, -1], o.logits[:, -1], tokens[:, j - 1])
            assert torch.allclose(feats[:, j - 1], ref, atol=1e-6)
    q = torch.softmax(out.logits[:, :-1].float(), -1)
    assert torch.allclose(feats[..., -3], q.gather(-1, tokens[..., None]).squeeze(-1))  # q(x)
    assert torch.allclose(feats[..., -2], q.max(-1).values)


def test_train_acceptance_artifact(workdir):
    from specdec.decode.drafters.adaptive import build_adaptive
    from specdec.train.trainers.acceptance import train_acceptance
    from specdec.models.loading import load_draft

    if not (workdir / "draft").exists():
        pytest.skip("needs the draft from test_kd_loss_falls_and_artifact")
    out = workdir / "acceptance"
    m = train_acceptance(workdir / "target", workdir / "draft", [workdir / "data.jsonl"], out, tiny_cfg(steps=8, batch=64, lr=1e-2))
    assert 0 <= m["sampling"]["brier"] <= 1 and m["sampling"]["reliability_bins"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["kind"] == "acceptance" and cfg["target"]["vocab_size"] > 0
    from types import SimpleNamespace
    from transformers import AutoTokenizer

    drafter = build_adaptive(out, load_draft(workdir / "draft"), SimpleNamespace(stop_threshold=0.3, min_draft=2, max_draft=20),
                             tokenizer=AutoTokenizer.from_pretrained(workdir / "target"))
    assert drafter.policies["sampling"].max_draft == 20


# ---------------------------------------------------------------------------------------------
# CLI and distributed


def test_cli_train_draft(workdir):
    

    res = invoke(["train-draft", "--target", str(workdir / "target"), "--data", str(workdir / "data.jsonl"),
                              "--out", str(workdir / "cli-draft"), "--arch", "layers=1,hidden=32,heads=4", "--max-steps", "2",
                              "--batch-size", "4", "--seq-len", "32", "--checkpoint-every", "0"])
    assert res.exit_code == 0, res.output
    assert (workdir / "cli-draft" / "model.safetensors").exists()
    res = invoke(["train-draft", "--target", str(workdir / "target"), "--data", str(workdir / "nope.jsonl"),
                              "--out", str(workdir / "cli-bad"), "--arch", "layers=1"])
    assert res.exit_code == 1 and "no such data file" in res.output
    res = invoke(["train-draft", "--target", str(workdir / "target"), "--data", str(workdir / "data.jsonl"),
                              "--out", str(workdir / "cli-bad"), "--arch", "depth=3"])
    assert res.exit_code == 2 and "--arch" in res.output


def test_accelerate_launch_two_processes(workdir):
    """accelerate launch --multi_gpu (torchrun) with 2 processes on CPU: gloo, same artifact kind."""
    exe = Path(sys.executable).with_name("accelerate")
    out = workdir / "ddp-draft"
    cmd = [str(exe), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "bf16",
           "--dynamo_backend", "no", "-m", "specdec", "train-draft", "--target", str(workdir / "target"),
           "--data", str(workdir / "data.jsonl"), "--out", str(out), "--arch", "layers=1,hidden=32,heads=4",
           "--max-steps", "3", "--batch-size", "2", "--seq-len", "32", "--checkpoint-every", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["steps"] == 3
    assert json.loads((out / "config.json").read_text())["specdec_kind"] == "draft"


@pytest.mark.slow
def test_recipe_hook_builds_family(workdir, tmp_path):
    import shutil

    from specdec.train.recipe import build_drafters as build_drafters_for_recipe

    shutil.copytree(workdir / "target", tmp_path / "target")
    res = build_drafters_for_recipe(tmp_path, [workdir / "data.jsonl"], budget_minutes=0.2, seed=0)
    assert set(res) == {"regen", "draft", "draft-ce", "acceptance", "medusa", "clover", "eagle"}
    assert res["regen"]["prompts"] >= 16  # the drafters trained on the target's own continuations
    assert len((tmp_path / "data" / "regen.jsonl").read_text().splitlines()) == res["regen"]["prompts"]
    assert res["draft-ce"]["kd_weight"] == 0.0 and res["draft"]["kd_weight"] > 0
    for member in set(res) - {"regen"}:
        assert (tmp_path / member / "metrics.json").exists()


def test_self_distill_writes_the_targets_greedy_continuations(workdir, tmp_path):
    """The recipe's self-distillation data is `specdec decode` output: prompt echoed, completion equal to
    plain greedy decoding (the n-gram drafter it uses is lossless); a spent budget writes nothing."""
    
    from specdec.train.data import load_texts, self_distill

    prompts = [t[:30] for t in corpus(12, seed=3)]
    n = self_distill(workdir / "target", prompts, tmp_path / "regen.jsonl", budget_s=600, max_new_tokens=12, batch_size=5)
    assert n == 12
    got = [json.loads(line) for line in (tmp_path / "regen.jsonl").read_text().splitlines()]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    res = invoke(["decode", "--in", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "ar.jsonl"),
                                   "--target", str(workdir / "target"), "--max-new-tokens", "12"])
    assert res.exit_code == 0, res.output
    ar = [json.loads(line) for line in (tmp_path / "ar.jsonl").read_text().splitlines()]
    assert [g["completion"] for g in got] == [a["completion"] for a in ar]
    assert load_texts([tmp_path / "regen.jsonl"]) == [p + g["completion"] for p, g in zip(prompts, got)]
    assert self_distill(workdir / "target", prompts, tmp_path / "none.jsonl", budget_s=0) == 0


def test_a_pretrained_recipes_self_distillation_mixes_code_and_prose_prompts_and_is_kept(workdir, tmp_path):
    """A pretrained target's recipe writes the target's continuations of code prompts cut from its training
    text and of prose chunks' first thirds, shuffled together; a second run keeps the file; a spent budget
    writes nothing."""
    import inspect
    import textwrap

    from specdec.train.recipe import pretrained_self_distill

    src = inspect.getsource(textwrap)
    code = tmp_path / "train.jsonl"
    code.write_text("".join(json.dumps({"prompt": src[i : i + 2000]}) + "\n" for i in range(0, len(src), 2000)))
    prose_texts = [" ".join(corpus(6, seed=s)) for s in range(4)]
    prose = tmp_path / "prose.jsonl"
    prose.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in prose_texts))
    spec = {"prompts": 8, "prose_fraction": 0.25, "max_new_tokens": 6, "batch_size": 4}
    out = tmp_path / "regen.jsonl"
    res = pretrained_self_distill(workdir / "target", code, prose, out, spec, 600, 0, False, None)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert res["records"] == res["prompts"] == len(records) > 2  # at most six code prompts (the anchors it finds) and two prose
    prompts = [r["prompt"] for r in records]
    prose_prompts = [t[: len(t) // 3] for t in prose_texts[:2]]
    assert sorted(p for p in prompts if p in prose_prompts) == sorted(prose_prompts)
    assert all(p in src for p in prompts if p not in prose_prompts)  # the others are prefixes cut from the code
    assert prompts[:2] != prose_prompts and prompts[-2:] != prose_prompts  # shuffled, not appended
    assert all(r["completion"] for r in records)
    before = out.read_text()
    assert pretrained_self_distill(workdir / "target", code, prose, out, spec, 600, 0, False, None) == \
        {"cached": True, "records": len(records), "file": str(out)}
    assert out.read_text() == before
    assert pretrained_self_distill(workdir / "target", code, prose, out, spec, 0, 0, True, None)["records"] == 0
    # a spent budget leaves no file (a later run tries again), nor a partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prose.jsonl", "train.jsonl"]


def test_acceptance_labelling_stops_at_its_deadline(draft_model):
    from specdec.train.trainers.acceptance_labels import build_features

    from datasets import Dataset

    blocks = Dataset.from_dict({"input_ids": torch.randint(3, 90, (24, 9)).tolist()}).with_format("torch")
    full_h, full_y = build_features(draft_model, draft_model, blocks, 1.0, 0.15, seed=0, batch=8)
    assert full_h.shape[0] == full_y.shape[0] == 24 * 8  # every judged position of every block
    late_h, late_y = build_features(draft_model, draft_model, blocks, 1.0, 0.15, seed=0, batch=8, deadline=0.0)
    assert late_h.shape[0] == 8 * 8 and torch.equal(late_y, full_y[: 8 * 8])  # one batch, then the deadline stops it


def test_weighted_bce_optimum_is_undone_by_log_w():
    """The saved acceptance head adds log w to its bias: that recovers y from the weighted optimum."""
    import math

    from specdec.train.trainers.acceptance import weighted_bce

    for y in (0.2, 0.5, 0.9):
        z = torch.zeros(1, requires_grad=True)
        opt = torch.optim.LBFGS([z], lr=0.5, max_iter=200)

        def closure():
            opt.zero_grad()
            loss = weighted_bce(z, torch.tensor([y]), 6.0)
            loss.backward()
            return loss

        opt.step(closure)
        assert torch.sigmoid(z + math.log(6.0)).item() == pytest.approx(y, abs=1e-4)
        assert torch.sigmoid(z).item() < y  # uncorrected, it leans low


def test_a_draft_over_a_reduced_vocabulary(workdir):
    """--draft-vocab N: a small Llama over the N - 1 most frequent training tokens (embedding started from
    the target's rows), distilled on the cached teacher's top-k over them; decodes exactly as ar, drafting
    only tokens of its vocabulary; the CLI reaches it."""
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.options import DecodeOptions
    from specdec.decode.drafters.registry import build_drafter
    from specdec.decode.engine.types import GenRequest
    from specdec.models import vocab as draft_vocab
    from specdec.models.loading import load_target
    from specdec.train.trainers.draft import train_draft

    out = workdir / "draft-vocab"
    m = train_draft(workdir / "target", [workdir / "data.jsonl"], out, tiny_cfg(steps=12, lr=1e-2),
                    arch="layers=1,hidden=32,heads=4", kd_weight=0.8, draft_vocab=24, teacher_topk=8)
    curve = m["loss_curve"]
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3
    assert m["draft_vocab"] == 24 and m["vocab_coverage_heldout"] > 0.5 and m["top1_agreement"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 24 and cfg["specdec_draft_vocab"] == 24
    vocab = draft_vocab.load(out)
    target, tok, _ = load_target(workdir / "target")
    drafter = build_drafter(str(out), target, tok, DecodeOptions())
    assert isinstance(drafter.model, draft_vocab.MappedVocabLM)
    prompts = [tok(t)["input_ids"] for t in ("the cat sat on", "a big red dog ran", "then it was")]
    reqs = [GenRequest(p, 14) for p in prompts]
    ar = SpecEngine(target, tok).generate(reqs)
    spec = SpecEngine(target, tok, drafter, num_draft=3).generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert sum(r.stats["drafted_tokens"] for r in spec) > 0
    with torch.no_grad():
        logits = drafter.model(input_ids=torch.tensor([prompts[0]])).logits
    allowed = torch.zeros(target.config.vocab_size, dtype=torch.bool)
    allowed[vocab.d2t[:-1]] = True
    assert torch.isinf(logits[..., ~allowed]).all() and torch.isfinite(logits[..., allowed]).all()
    res = invoke(["train-draft", "--target", workdir / "target", "--data", workdir / "data.jsonl", "--out", workdir / "dv-cli",
                  "--arch", "layers=1,hidden=32,heads=4", "--draft-vocab", "20", "--max-steps", "2", "--seq-len", "32",
                  "--batch-size", "4", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert draft_vocab.load(workdir / "dv-cli").size == 20
