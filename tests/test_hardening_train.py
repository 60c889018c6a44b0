"""Training survives crashes: atomic checkpoints with a fallback to the previous one, resume after a
SIGKILL to bit-identical weights, the budget's clock carried across a resume, and a teacher cache
keyed by what it was computed from."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec.tests.test_train import _Toy, _ToyData, _toy_loss, make_target_dir, tiny_cfg, write_decode_output
from specdec.train import loop
from specdec.train.loop import run_training

ARCH = "layers=1,hidden=32,heads=4"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    make_target_dir(root / "target", hidden=32)
    make_target_dir(root / "target-b", hidden=32, seed=1)  # same tokenizer and shapes, other weights
    data = write_decode_output(root / "data.jsonl", n=60)
    # the same records in reverse order: the same tokens, so the same number of blocks, other blocks
    lines = data.read_text().splitlines()
    (root / "data-reversed.jsonl").write_text("\n".join(reversed(lines)) + "\n")
    return root


# ---------------------------------------------------------------------------------------------
# teacher cache


def _cache(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_teacher_cache_follows_data_and_target_and_survives_a_torn_file(work, tmp_path, capsys):
    from specdec.train.trainers.draft import train_draft

    cfg = tiny_cfg(steps=1, mixed_precision="no", save_final_checkpoint=False)

    def train(target: str, data: str, out: Path) -> dict:
        train_draft(work / target, [work / data], out, cfg, arch=ARCH, kd_weight=0.9, cache_teacher=True, teacher_topk=8)
        return _cache(out / "teacher_cache.safetensors")

    shared = tmp_path / "shared"
    first = train("target", "data.jsonl", shared)
    fresh_rev = train("target", "data-reversed.jsonl", tmp_path / "fresh-rev")
    assert first["values"].shape == fresh_rev["values"].shape  # what a shape check cannot tell apart
    assert not _same(first, fresh_rev)

    # other data into the same --out: recomputed, not the first data's logits
    assert _same(train("target", "data-reversed.jsonl", shared), fresh_rev)
    assert "computed for other data" in capsys.readouterr().err
    # another target of the same shapes
    fresh_b = train("target-b", "data-reversed.jsonl", tmp_path / "fresh-b")
    assert _same(train("target-b", "data-reversed.jsonl", shared), fresh_b)
    assert "computed for other target" in capsys.readouterr().err
    # unchanged inputs: reused as is
    path = shared / "teacher_cache.safetensors"
    stamp = path.stat().st_mtime_ns
    assert _same(train("target-b", "data-reversed.jsonl", shared), fresh_b) and path.stat().st_mtime_ns == stamp

    # a torn file (cut in the data, in the header) or a foreign one is recomputed, not a crash
    whole = path.read_bytes()
    for torn in (whole[: len(whole) // 2], whole[:5], b"not a safetensors file"):
        path.write_bytes(torn)
        assert _same(train("target-b", "data-reversed.jsonl", shared), fresh_b)
        assert "unreadable" in capsys.readouterr().err
    assert not list(shared.glob(".teacher_cache*"))  # no temporary file left behind


# ---------------------------------------------------------------------------------------------
# checkpoints


class _Crash(Exception):
    pass


def _crash_at(call: int):
    calls = {"n": 0}

    def loss(model, batch):
        calls["n"] += 1
        if calls["n"] == call:
            raise _Crash()
        return _toy_loss(model, batch)

    return loss


def test_truncated_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    cfg = tiny_cfg(steps=8, batch=5, checkpoint_every=1, lr=0.05, mixed_precision="no")
    full = run_training(cfg, _Toy(), _toy_loss, _ToyData(), tmp_path / "full")
    out = tmp_path / "split"
    with pytest.raises(_Crash):
        run_training(cfg, _Toy(), _crash_at(6), _ToyData(), out)  # dies in step 6: step-4 and step-5 are kept
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-4", "step-5"]
    weights = ckpts / "step-5" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # the weights lost their tail; trainer_state.json is intact
    (ckpts / "step-6.tmp").mkdir()  # the remains of a write cut short are not a checkpoint
    capsys.readouterr()
    resumed = run_training(cfg, _Toy(), _toy_loss, _ToyData(), out, resume=True)
    err = capsys.readouterr().err
    assert f"warning: checkpoint {ckpts / 'step-5'} is incomplete or corrupt (model.safetensors has" in err
    assert f"resuming from {ckpts / 'step-4'}" in err
    assert resumed.losses == full.losses
    assert torch.equal(resumed.model.lin.weight, full.model.lin.weight) and torch.equal(resumed.model.lin.bias, full.model.lin.bias)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-7", "step-8"]


def test_no_intact_checkpoint_starts_over_and_legacy_ones_are_checked(tmp_path, capsys):
    cfg = tiny_cfg(steps=4, batch=5, checkpoint_every=1, lr=0.05, mixed_precision="no")
    full = run_training(cfg, _Toy(), _toy_loss, _ToyData(), tmp_path / "full")
    out = tmp_path / "split"
    with pytest.raises(_Crash):
        run_training(cfg, _Toy(), _crash_at(4), _ToyData(), out)
    ckpts = out / "checkpoints"
    # step-3 as a checkpoint from before manifests (no COMPLETE) with torn weights, step-2 with a flipped byte
    (ckpts / "step-3" / loop.MARKER).unlink()
    w3 = ckpts / "step-3" / "model.safetensors"
    w3.write_bytes(w3.read_bytes()[:-4])
    w2 = ckpts / "step-2" / "model.safetensors"
    raw = bytearray(w2.read_bytes())
    raw[-1] ^= 0xFF
    w2.write_bytes(bytes(raw))
    capsys.readouterr()
    resumed = run_training(cfg, _Toy(), _toy_loss, _ToyData(), out, resume=True)
    err = capsys.readouterr().err
    assert "checkpoint" in err and "step-3 is incomplete or corrupt (model.safetensors:" in err
    assert "step-2 is incomplete or corrupt (model.safetensors does not match its checksum)" in err
    assert "starting from scratch" in err
    assert resumed.losses == full.losses and torch.equal(resumed.model.lin.weight, full.model.lin.weight)
    # an intact checkpoint without a manifest (written before manifests existed) still resumes
    (ckpts / "step-4" / loop.MARKER).unlink()
    assert loop.latest_checkpoint(ckpts) == ckpts / "step-4"


def test_keep_is_at_least_two(tmp_path):
    cfg = tiny_cfg(steps=5, batch=5, checkpoint_every=1, keep_checkpoints=1, mixed_precision="no")
    run_training(cfg, _Toy(), _toy_loss, _ToyData(), tmp_path / "k")
    assert sorted(p.name for p in (tmp_path / "k" / "checkpoints").iterdir()) == ["step-4", "step-5"]


class _FakeTime:
    """A clock that moves only when a training step runs: budget arithmetic becomes exact."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


def test_budget_clock_carries_over_a_resume(tmp_path, monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(loop, "time", fake)

    def slow(model, batch):
        fake.now += 0.1  # every step takes 0.1 s of training time
        return _toy_loss(model, batch)

    def crashing_at(call):
        calls = {"n": 0}

        def loss(model, batch):
            calls["n"] += 1
            if calls["n"] == call:
                raise _Crash()
            return slow(model, batch)

        return loss

    # a 1.55 s budget, a cosine that follows the clock, a step cap far away
    cfg = tiny_cfg(steps=10_000, batch=5, checkpoint_every=1, warmup=0, budget_minutes=1.55 / 60, clock_schedule=True,
                   lr=0.05, mixed_precision="no")
    full = run_training(cfg, _Toy(), slow, _ToyData(), tmp_path / "full")
    assert full.stopped == "budget" and full.steps == 16 and full.elapsed_s == pytest.approx(1.6)
    with pytest.raises(_Crash):
        run_training(cfg, _Toy(), crashing_at(8), _ToyData(), tmp_path / "split")
    fake.now += 500.0  # time between the crash and the resume is not training time
    resumed = run_training(cfg, _Toy(), slow, _ToyData(), tmp_path / "split", resume=True)
    assert resumed.stopped == "budget" and resumed.steps == full.steps
    assert resumed.elapsed_s == pytest.approx(1.6) and resumed.wall_s == pytest.approx(0.9)
    lrs = [e["lr"] for e in resumed.logs]
    assert lrs == pytest.approx([e["lr"] for e in full.logs], rel=1e-6)  # no jump back up after the resume
    assert resumed.losses == pytest.approx(full.losses, rel=1e-6)
    state = json.loads((tmp_path / "split" / "checkpoints" / "step-16" / "trainer_state.json").read_text())
    assert state["elapsed_s"] == pytest.approx(1.6)
    # resuming a run whose budget is spent trains nothing more
    again = run_training(cfg, _Toy(), slow, _ToyData(), tmp_path / "split", resume=True)
    assert again.steps == 16 and again.stopped == "budget"


# ---------------------------------------------------------------------------------------------
# SIGKILL of a real train-draft process


RECIPE = """draft:
  lr: 3.0e-3
  batch: 4
  seq_len: 32
  warmup: 1
  seed: 3
  heldout: 0.15
  mixed_precision: "no"
  clock_schedule: true
  extra: {kd_weight: 0.5, temperature: 1.0, ce_labels: target}
"""


def _cmd(work: Path, out: Path, *extra: str) -> list[str]:
    recipe = work / "recipe.yaml"
    if not recipe.exists():
        recipe.write_text(RECIPE)
    return [sys.executable, "-m", "specdec", "train-draft", "--target", str(work / "target"), "--data", str(work / "data.jsonl"),
            "--out", str(out), "--arch", ARCH, "--recipe", str(recipe), *extra]


def _env() -> dict:
    # one thread: the same float reductions in every run, and no fight over a small machine's cores
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_killed(cmd: list[str], trigger, log: Path, timeout: float = 180.0) -> int | None:
    """Run ``cmd``; SIGKILL it as soon as ``trigger()`` holds. Returns its exit code, None if killed."""
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=fh, env=_env())
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if trigger() or time.monotonic() > deadline:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    return None
                time.sleep(0.002)
            return proc.returncode
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _weights(out: Path) -> dict:
    return _cache(out / "model.safetensors")


def test_sigkilled_train_draft_resumes_to_identical_weights(work, tmp_path):
    steps = ["--max-steps", "6", "--checkpoint-every", "1", "--cache-teacher"]
    ref = tmp_path / "ref"
    assert run_killed(_cmd(work, ref, *steps), lambda: False, tmp_path / "ref.log") == 0, (tmp_path / "ref.log").read_text()[-3000:]

    out, log = tmp_path / "killed", tmp_path / "killed.log"
    ckpts = out / "checkpoints"
    began = {}

    def after(seconds):
        def trigger():
            began.setdefault(seconds, time.monotonic())
            return time.monotonic() - began[seconds] > seconds
        return trigger

    triggers = [
        # while the teacher cache is written (or, if that was too quick to catch, just after)
        lambda: any(out.glob(".teacher_cache*")) or (ckpts / "step-1").exists(),
        lambda: (ckpts / "step-3.tmp").exists() or (ckpts / "step-3").exists(),  # inside a checkpoint write
        lambda: (ckpts / "step-5").exists(),  # right after a rename
        after(random.Random(0).uniform(3.0, 6.0)),  # anywhere, the final save included
    ]
    killed, torn = 0, []
    for i, trigger in enumerate(triggers):
        flag = [] if i == 0 else ["--resume"]
        rc = run_killed(_cmd(work, out, *steps, *flag), trigger, log)
        if rc is None:
            killed += 1
            torn += [p.name for p in ckpts.glob("*.tmp")] + [p.name for p in out.glob(".teacher_cache*")]
        else:  # it finished before the trigger fired: nothing left to interrupt
            assert rc == 0, log.read_text()[-3000:]
            break
    print("killed", killed, "times; left half-written:", torn)
    assert killed >= 3
    for _ in range(3):
        if run_killed(_cmd(work, out, *steps, "--resume"), lambda: False, log) == 0:
            break
    else:
        pytest.fail(log.read_text()[-3000:])
    assert "Traceback" not in log.read_text()
    got, want = _weights(out), _weights(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "metrics.json").read_text())["loss_curve"] == json.loads((ref / "metrics.json").read_text())["loss_curve"]


def test_sigkill_then_resume_keeps_the_budget(work, tmp_path):
    budget_s = 4.2
    out, log = tmp_path / "b", tmp_path / "b.log"
    cmd = _cmd(work, out, "--max-steps", "1000000", "--checkpoint-every", "5", "--budget-minutes", str(budget_s / 60))
    first = {}

    def trigger():  # about half the budget in
        if not (out / "checkpoints").exists() or not any(out.glob("checkpoints/step-*")):
            return False
        first.setdefault("t", time.monotonic())
        return time.monotonic() - first["t"] > budget_s / 2

    assert run_killed(cmd, trigger, log) is None
    latest = loop.latest_checkpoint(out / "checkpoints")
    spent = json.loads((latest / "trainer_state.json").read_text())["elapsed_s"]
    assert 0 < spent < budget_s
    assert run_killed(cmd + ["--resume"], lambda: False, log) == 0, log.read_text()[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    final = json.loads((loop.latest_checkpoint(out / "checkpoints") / "trainer_state.json").read_text())
    assert metrics["stopped"] == "budget"
    assert budget_s < final["elapsed_s"] < budget_s + 1.0  # the first part counted: one budget in all
    assert metrics["train_wall_s"] < budget_s - spent + 1.0


def test_teacher_forwards_batch_many_blocks_on_a_gpu_and_four_on_a_cpu():
    from specdec.train.teacher import teacher_batch

    assert teacher_batch(torch.device("cpu"), 256, 19, 640, 16383) == 4
    # Gemma 3 270M's pass over 256-token blocks with a 16k draft vocabulary: 29 MB a block, 68 blocks in 2 GB
    assert teacher_batch(torch.device("cuda"), 256, 19, 640, 16383) == 68
    assert teacher_batch(torch.device("cuda"), 4096, 33, 4096, 128256) == 4  # never fewer than a CPU's
    assert teacher_batch(torch.device("cuda"), 8, 3, 16, 32) == 256  # nor more than 256
