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


