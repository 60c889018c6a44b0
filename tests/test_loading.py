"""The one model-loading layer: folders, hub ids (offline, from a hub cache laid out as the hub client
lays it out), placement options, and clear errors for what cannot load."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import invoke, save_tiny_lm, tiny_tokenizer

from specdec.models.errors import SpecdecError, UsageError
from specdec.models.loading import Placement, apply_threads, load_target, resolve_dtype, resolve_source


def _hub_cache(root, repo: str, model_dir):
    """Copy a saved model into ``root`` as huggingface_hub's cache stores a snapshot of ``repo``."""
    import shutil

    commit = "0123456789abcdef0123456789abcdef01234567"
    base = root / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    shutil.copytree(model_dir, snap)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    return root


def _run(args, env):
    return subprocess.run([sys.executable, "-m", "specdec", *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_a_hub_id_decodes_offline_from_the_hub_cache_as_its_folder_does(tiny_family, tmp_path):
    cache = _hub_cache(tmp_path / "hub", "acme/tiny-code", tiny_family / "target")
    _hub_cache(cache, "acme/tiny-code-draft", tiny_family / "draft")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"def f{i}(x):\n"}) + "\n" for i in range(3)))
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    by_id = _run(["decode", "--in", src, "--out", tmp_path / "a.jsonl", "--target", "acme/tiny-code", "--max-new-tokens", "8"], env)
    assert by_id.returncode == 0, by_id.stderr[-2000:]
    by_dir = _run(["decode", "--in", src, "--out", tmp_path / "b.jsonl", "--target", tiny_family / "target", "--max-new-tokens", "8"], env)
    assert by_dir.returncode == 0, by_dir.stderr[-2000:]
    drafted = _run(["decode", "--in", src, "--out", tmp_path / "d.jsonl", "--target", "acme/tiny-code", "--drafter",
                    "acme/tiny-code-draft", "--max-new-tokens", "8"], env)
    assert drafted.returncode == 0, drafted.stderr[-2000:]
    outs = (tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "d.jsonl")
    completions = [[json.loads(line)["completion"] for line in open(p)] for p in outs]
    assert completions[0] == completions[1] == completions[2]
    assert sum(json.loads(line)["stats"]["drafted_tokens"] for line in open(tmp_path / "d.jsonl")) > 0
    missing = _run(["decode", "--in", src, "--out", tmp_path / "c.jsonl", "--target", "acme/not-cached", "--max-new-tokens", "8"], env)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert missing.stderr.strip().splitlines()[-1].startswith("error: ") and "acme/not-cached" in missing.stderr
    assert not (tmp_path / "c.jsonl").exists() or (tmp_path / "c.jsonl").read_text() == ""


def test_resolve_source():
    assert resolve_source("org/model") == "org/model"
    with pytest.raises(SpecdecError, match="no such model folder"):
        resolve_source("./missing/dir")


def test_device_map_auto_places_and_decodes_like_a_plain_load(tiny_family):
    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest

    plain, tok, _ = load_target(tiny_family / "target", Placement(device="cpu"))
    mapped, _, _ = load_target(tiny_family / "target", Placement(device="cpu", device_map="auto"))
    # on a machine without GPUs accelerate keeps every layer on the CPU; tests marked cuda check a real split
    prompts = [tok(f"def g{i}(a, b):\n")["input_ids"] for i in range(2)]
    outs = [SpecEngine(m, tok).generate([GenRequest(p, 10) for p in prompts]) for m in (plain, mapped)]
    assert [r.token_ids for r in outs[0]] == [r.token_ids for r in outs[1]]


def test_dtype_auto_is_float32_on_a_cpu_and_explicit_dtypes_are_honoured(tiny_family):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_family / "target")
    cfg.dtype = torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu"), cfg) in (torch.float32, torch.bfloat16)  # bf16 only with native bf16
    assert resolve_dtype("float16", torch.device("cpu"), cfg) == torch.float16
    model, _, _ = load_target(tiny_family / "target", Placement(device="cpu", dtype="bfloat16"))
    assert model.dtype == torch.bfloat16


def test_threads_follow_the_work_of_a_forward(tiny_family):
    import os

    from specdec.models.loading import THREADS_MIN_WORK

    small, _, _ = load_target(tiny_family / "target", Placement(device="cpu"))
    size = sum(p.numel() for p in small.parameters())
    assert size < THREADS_MIN_WORK  # the test family's target is below the line at one row
    assert apply_threads(0, small) == 1
    enough = -(-THREADS_MIN_WORK // size)  # rows that make its forwards worth every core
    assert apply_threads(0, small, rows=enough - 1) == 1
    assert apply_threads(0, small, rows=enough) == (os.cpu_count() or 1)
    load_target(tiny_family / "target", Placement(device="cpu"), rows=enough)
    assert torch.get_num_threads() == (os.cpu_count() or 1)
    assert apply_threads(3) == 3
    torch.set_num_threads(1)


@pytest.mark.parametrize("args,needle", [
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:7"], "cuda"),
    (["--dtype", "int8"], "--dtype"),
    (["--attn-implementation", "flash_attention_2"], "4-D"),
    (["--threads", "-4"], "--threads"),
    (["--device-map", "balanced"], "--device-map"),
])
def test_bad_placement_options_are_usage_errors_before_loading(tiny_family, tmp_path, args, needle):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x = 1"}\n')
    res = invoke(["decode", "--in", src, "--out", tmp_path / "o.jsonl", "--target", tiny_family / "target", *args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], res.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_unloadable_targets_end_in_one_error_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x = 1"}\n')
    bad_json = tmp_path / "bad-config"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{not json")
    tok = tiny_tokenizer()
    torn = save_tiny_lm(tmp_path / "torn", tok)
    weights = next(torn.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    pickled = save_tiny_lm(tmp_path / "pickled", tok)
    for f in pickled.glob("*.safetensors"):
        f.unlink()
    for target, needle in [(bad_json, "not valid JSON"), (torn, "torn"), (pickled, "safetensors")]:
        res = invoke(["decode", "--in", src, "--out", tmp_path / f"{target.name}.jsonl", "--target", target])
        assert res.exit_code == 1, res.output
        lines = res.stderr.strip().splitlines()
        assert lines[-1].startswith("error: ") and "Traceback" not in res.stderr, res.stderr
        assert needle in res.stderr or target.name in res.stderr


def test_placement_validates_itself():
    with pytest.raises(UsageError):
        Placement(dtype="float8")
    with pytest.raises(UsageError):
        Placement(attn_implementation="flash_attention_2")


def test_threads_follow_the_cores_other_processes_leave_free(monkeypatch):
    """--threads 0: a core kept busy by another process is left to it (every op's barrier would wait
    for the thread placed there); when it frees up, the count returns to the ceiling."""
    from specdec.models import threads

    clock = {"t": 100.0, "busy": 0.0, "own": 0.0}
    monkeypatch.setattr(threads, "allowed_cpus", lambda: [0, 1])
    monkeypatch.setattr(threads, "_cpu_busy", lambda cpus: clock["busy"])
    monkeypatch.setattr(threads, "_own_ticks", lambda: clock["own"])
    monkeypatch.setattr(threads.time, "monotonic", lambda: clock["t"])
    gov = threads.follow_load(2)
    hz = gov.hz

    def interval(seconds, ours, others):  # cores' worth of work over ``seconds``
        clock["t"] += seconds
        clock["own"] += ours * seconds * hz
        clock["busy"] += (ours + others) * seconds * hz

    try:
        interval(1.0, 2.0, 0.0)
        assert threads.tick() == 2  # not re-read before the period has passed
        interval(2.0, 1.0, 1.0)  # another process takes a whole core
        assert threads.tick() == 1 and torch.get_num_threads() == 1
        interval(3.0, 1.0, 0.05)  # background noise leaves both cores free
        assert threads.tick() == 2 and torch.get_num_threads() == 2
        interval(3.0, 1.0, 2.0)  # both busy elsewhere: still one thread
        assert threads.tick() == 1
        assert [t for _, t in gov.history] == [1, 2, 1]
        threads.fix(3)
        assert threads.tick() is None and torch.get_num_threads() == 3
    finally:
        threads.fix(os.cpu_count() or 1)
