"""The ``pycode`` recipe built on a CPU at toy sizes: its corpus and held-out manifest, bits/byte, the
runner on a pycode-shaped config, shipping a family (bf16, shards, size caps, model card), sharded
artifacts loading and decoding, and which family is the default."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

from specdec.models.errors import SpecdecError, UsageError
from specdec.recipes import recipe_path
from specdec.train.corpus import load_corpus
from specdec.train.recipe import RecipeConfig

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def small_tree(root: Path) -> Path:
    """A handful of small stdlib modules copied under ``root``: the corpus the runner tests read."""
    for rel in ("json", "email", "urllib", "http", "logging", "importlib/metadata"):
        for p in sorted((STDLIB / rel).glob("*.py")):
            if p.stat().st_size < 40_000:
                (root / rel).mkdir(parents=True, exist_ok=True)
                (root / rel / p.name).write_bytes(p.read_bytes())
    return root


def tiny_recipe(tmp: Path, corpus_root: Path, **over) -> Path:
    """A pycode-shaped recipe at toy sizes (the same keys as recipes/pycode.yaml)."""
    cfg = yaml.safe_load(recipe_path("pycode").read_text())
    cfg.update(
        name="pycode-test", budget_minutes=1, device="cpu", mixed_precision="no",
        corpus={"source": "python", "roots": [str(corpus_root)], "max_file_bytes": 30_000},
        tokenizer={"vocab_size": 384, "max_bytes": 300_000},
        target={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 4, "max_position_embeddings": 512, "tie_word_embeddings": True},
        training={"seq_len": 64, "batch_size": 4, "lr": 3e-3, "max_steps": 3, "eval_blocks": 8},
        heldout_fraction=0.2, eval_prompts=3, eval_new_tokens=16,
    )
    cfg.update(over)
    path = tmp / "pycode-test.yaml"
    path.write_text("# specdec recipe run pycode-test.yaml\n" + yaml.safe_dump(cfg))
    return path


# ---------------------------------------------------------------------------------------------
# The recipe's sizes


def test_pycode_sizes_fit_the_family_cap():
    """The YAML's target is 12-14M parameters and its shipped members fit 60 MB in bf16 (weights alone
    leave room for tokenizers and metrics); medusa and the dLLM would not fit beside them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.acceptance import AcceptanceHead
    from specdec.models.head_artifacts import build_heads
    from specdec.train.trainers.draft import new_draft
    from specdec.train.ship import ExportPlan

    cfg = RecipeConfig.load(recipe_path("pycode"))
    plan = ExportPlan.from_recipe(cfg.export)
    assert cfg.corpus["source"] == "python" and cfg.device == "cuda" and cfg.mixed_precision == "bf16"
    assert abs(sum(cfg.shares.values()) - 1.0) < 1e-9 and cfg.budget_minutes <= 9
    with torch.device("meta"):
        target = LlamaForCausalLM(LlamaConfig(vocab_size=cfg.tokenizer["vocab_size"], **cfg.target))
        sizes = {"target": sum(p.numel() for p in target.parameters())}
        for kind in ("medusa", "clover", "eagle"):
            sizes[kind] = sum(t.numel() for t in build_heads(kind, target, {}).state_dict().values())
        sizes["draft"] = sizes["draft-ce"] = sum(p.numel() for p in new_draft(target.config, cfg.drafters["arch"]).parameters())
    hidden = int(cfg.drafters["arch"].split("hidden=")[1].split(",")[0])
    sizes["acceptance"] = 2 * sum(p.numel() for p in AcceptanceHead(hidden + 3).parameters())  # greedy and sampling heads
    sizes["dllm"] = sizes["target"]
    assert 12e6 <= sizes["target"] <= 14e6
    shipped = sum(2 * sizes[m] for m in plan.members)
    assert shipped <= 0.9 * plan.max_total_mb * 1e6
    assert shipped + 2 * sizes["medusa"] > plan.max_total_mb * 1e6 and shipped + 2 * sizes["dllm"] > plan.max_total_mb * 1e6
    assert 2 * target.model.embed_tokens.weight.numel() <= plan.max_file_mb * 1e6  # the largest tensor fits one file


# ---------------------------------------------------------------------------------------------
# Corpus, manifest, bits/byte


def test_python_corpus_dedupes_caps_skips_and_records_heldout_hashes(tmp_path):
    root = tmp_path / "site"
    for i in range(40):
        (root / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 4}" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    (root / "pkg0" / "copy.py").write_text("def f0(x):\n    return x + 0\n")  # the contents of pkg0/m0.py
    (root / "pkg1" / "table.py").write_text("T = [" + "1, " * 20_000 + "]\n")
    (root / "pkg2" / "latin1.py").write_bytes(b"# caf\xe9\n")
    (root / "pkg3" / "notes.txt").write_text("not python")
    corpus = load_corpus("python", heldout_fraction=0.25, roots=[root], max_file_bytes=10_000)

    assert corpus.skipped == {"duplicate": 1, "too_large": 1, "unreadable": 1}
    assert len(corpus.train_files) + len(corpus.heldout_files) == 40 and corpus.heldout_files
    assert not set(corpus.train_files) & set(corpus.heldout_files)
    again = load_corpus("python", heldout_fraction=0.25, roots=[root], max_file_bytes=10_000)
    assert again.heldout_files == corpus.heldout_files
    manifest = json.loads(json.dumps(corpus.manifest()))
    assert manifest["train_files"] == len(corpus.train_files) and manifest["heldout_files"] == len(corpus.heldout_files)
    assert manifest["train_bytes"] == sum(p.stat().st_size for p in corpus.train_files)
    for entry in manifest["heldout"]:
        data = (root / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["bytes"] == len(data)
    train_hashes = {hashlib.sha256(p.read_bytes()).hexdigest() for p in corpus.train_files}
    assert not train_hashes & {e["sha256"] for e in manifest["heldout"]}


def test_stdlib_corpus_keeps_installed_packages_out():
    corpus = load_corpus("stdlib")
    names = {corpus.name(p) for p in corpus.train_files + corpus.heldout_files}
    assert "json/__init__.py" in names and not any("site-packages" in n for n in names)


def test_bits_per_byte_by_hand():
    """A model with uniform logits scores ln V nats a token; bits/byte is the total over the UTF-8 bytes
    of the predicted tokens, times 1/ln 2."""
    from conftest import tiny_tokenizer

    from specdec.train.trainers.lm import TokenBlocks, bits_per_byte, heldout_metrics, token_byte_lengths

    assert bits_per_byte(2 * math.log(2), 2) == pytest.approx(1.0)
    assert bits_per_byte(10.0, 4) == pytest.approx(10.0 / (4 * 0.6931471805599453))
    tok = tiny_tokenizer()
    lengths = token_byte_lengths(tok)
    text = "def café(x):\n    return 'ü' * x\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert lengths[tok.eos_token_id] == 0

    class Uniform(torch.nn.Module):
        device = torch.device("cpu")

        def forward(self, input_ids):
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, len(tok))})()

    seq = torch.tensor(ids[:12], dtype=torch.int32)
    blocks = TokenBlocks(torch.stack([seq, seq.flip(0)]))
    m = heldout_metrics(Uniform(), blocks, lengths, batch_size=1, mixed_precision="no")
    predicted = torch.cat([seq[1:], seq.flip(0)[1:]]).long()
    n_bytes = int(lengths[predicted].sum())
    assert m["heldout_tokens"] == 22 and m["heldout_bytes"] == n_bytes
    assert m["heldout_loss"] == pytest.approx(math.log(len(tok)), abs=1e-4)
    assert m["heldout_bits_per_byte"] == pytest.approx(22 * math.log(len(tok)) / (n_bytes * math.log(2)), abs=1e-4)


# ---------------------------------------------------------------------------------------------
# The runner on a pycode-shaped config, and shipping what it built


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The target stage of a toy pycode recipe, built once for the tests below."""
    from specdec.train.recipe import run_recipe

    tmp = tmp_path_factory.mktemp("pycode")
    recipe = tiny_recipe(tmp, small_tree(tmp / "src"))
    mp = pytest.MonkeyPatch()
    mp.setenv("SPECDEC_HOME", str(tmp / "home"))
    report = run_recipe(recipe, only=["target", "prompts"], command="specdec recipe run pycode-test.yaml --only target")
    yield tmp, recipe, report
    mp.undo()


def test_runner_builds_the_target_with_its_metrics_and_manifest(built):
    tmp, recipe, report = built
    fam = tmp / "home" / "pycode-test"
    metrics = json.loads((fam / "target" / "metrics.json").read_text())
    for key in ("heldout_loss", "heldout_bits_per_byte", "tokens_trained", "tokens_per_s", "wall_s", "hardware", "distinct4"):
        assert key in metrics, key
    assert metrics["steps"] == 3 and metrics["tokens_trained"] == 3 * 4 * 64
    assert 0 < metrics["heldout_bits_per_byte"] < metrics["heldout_loss"] and metrics["distinct4"] > 0
    split = json.loads((fam / "target" / "corpus_split.json").read_text())
    src = tmp / "src"
    heldout = {e["path"] for e in split["heldout"]}
    assert heldout and split["source"] == "python" and split["train_files"] == metrics["train_files"]
    for e in split["heldout"]:
        assert hashlib.sha256((src / e["path"]).read_bytes()).hexdigest() == e["sha256"]
    prompts = [json.loads(line) for line in (fam / "prompts.jsonl").read_text().splitlines()]
    assert prompts and all(p["source"].rsplit(":", 1)[0] in heldout for p in prompts)
    train_text = {p.read_text() for p in src.rglob("*.py") if p.relative_to(src).as_posix() not in heldout}
    assert not {(src / h).read_text() for h in heldout} & train_text
    assert report["runs"][-1]["stages"] == ["target", "prompts"] and report["device"] == "cpu"


def test_same_seed_same_target(built, tmp_path, monkeypatch):
    """A second build from scratch with the same seed gives the same weights (fixed steps)."""
    from safetensors.torch import load_file

    from specdec.train.recipe import run_recipe

    tmp, recipe, _ = built
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    run_recipe(recipe, only=["target"])
    a = load_file(str(tmp / "home" / "pycode-test" / "target" / "model.safetensors"))
    b = load_file(str(tmp_path / "home" / "pycode-test" / "target" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_writes_bf16_shards_and_a_model_card_that_load_and_decode(built, tmp_path, monkeypatch):
    """Shipped in files of at most 0.05 MB: the target is sharded, loads on a CPU as float32 and decodes
    greedily as transformers' generate does on the loaded model."""
    from transformers import AutoModelForCausalLM

    from specdec.decode.engine.loop import SpecEngine
    from specdec.decode.engine.types import GenRequest
    from specdec.models import loading
    from specdec.train.ship import ExportPlan, ship_family

    tmp, recipe, _ = built
    fam = tmp / "home" / "pycode-test"
    out = tmp_path / "families" / "pycode"
    res = ship_family(fam, out, ExportPlan(members=["target"], max_file_mb=0.05, max_total_mb=2.0), "specdec recipe export x")
    assert res["files"] and all(size <= 50_000 for size in res["files"].values())
    assert res["total_bytes"] == sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) <= 2_000_000
    shards = sorted((out / "target").glob("model-*.safetensors"))
    assert len(shards) >= 2 and (out / "target" / "model.safetensors.index.json").exists()
    assert json.loads((out / "target" / "config.json").read_text())["dtype"] == "bfloat16"
    card = (out / "README.md").read_text()
    for needle in ("bits/byte", "nats/token", "distinct-4", "PSF", "specdec recipe run pycode-test.yaml --only target",
                   "specdec recipe export x", "target/corpus_split.json"):
        assert needle in card, needle

    monkeypatch.setattr(loading, "native_bf16", lambda device: False)
    model, tok, _ = loading.load_target(str(out / "target"), loading.Placement(device="cpu"))
    assert model.dtype == torch.float32
    saved = AutoModelForCausalLM.from_pretrained(fam / "target", dtype=torch.float32)
    assert all(torch.equal(p, saved.state_dict()[k].to(torch.bfloat16).float()) for k, p in model.state_dict().items())
    prompt = tok("def parse(text):\n    ", return_tensors="pt")["input_ids"]
    ours = SpecEngine(model, tok, eos_ids=[]).generate([GenRequest(prompt[0].tolist(), 12)])[0].token_ids
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False, eos_token_id=-1,
                         pad_token_id=tok.pad_token_id)
    assert list(ours) == ref[0, prompt.shape[1]:].tolist()


def test_export_refuses_a_family_over_its_cap_with_one_error(built, tmp_path):
    from specdec.train.ship import ExportPlan, ship_family

    tmp, _, _ = built
    out = tmp_path / "families" / "pycode"
    with pytest.raises(SpecdecError, match=r"over its 0.01 MB cap \(bf16 weights in MB: target 0\.\d"):
        ship_family(tmp / "home" / "pycode-test", out, ExportPlan(members=["target"], max_total_mb=0.01), "x")
    assert not out.exists() and not out.with_name("pycode.tmp").exists()
    with pytest.raises(SpecdecError, match="not built"):
        ship_family(tmp / "home" / "pycode-test", out, ExportPlan(members=["target", "eagle"]), "x")
    with pytest.raises(UsageError, match="needs its target"):
        ExportPlan.from_recipe({}, ["draft"])


def test_cli_recipe_export_and_device_check(built, tmp_path, monkeypatch):
    from conftest import invoke

    tmp, recipe, _ = built
    monkeypatch.setenv("SPECDEC_HOME", str(tmp / "home"))
    res = invoke(["recipe", "export", str(recipe), "--out", str(tmp_path / "fam"), "--members", "target"])
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and (tmp_path / "fam" / "target" / "model.safetensors").exists()
    res = invoke(["recipe", "export", str(recipe), "--out", str(tmp_path / "fam"), "--members", "target"])
    assert res.exit_code == 0, res.output  # a family shipped before is replaced
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    res = invoke(["recipe", "export", str(recipe), "--out", str(tmp_path / "mine"), "--members", "target"])
    assert res.exit_code == 2 and "notes.txt" in res.output  # a folder of something else is never replaced
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    if not torch.cuda.is_available():
        res = invoke(["recipe", "run", str(recipe), "--device", "cuda", "--only", "target"])
        assert res.exit_code == 2 and "no CUDA device" in res.output


# ---------------------------------------------------------------------------------------------
# Sharded specdec artifacts, the default family


def test_sharded_head_artifact_loads_as_its_single_file(tmp_path):
    from conftest import tiny_llama

    from specdec.models.artifacts import load_weights, save_weights
    from specdec.models.head_artifacts import build_heads, load_heads, save_heads

    target = tiny_llama()
    heads = build_heads("eagle", target, {})
    torch.nn.init.normal_(heads.fc.weight)
    save_heads(heads, tmp_path / "one", {"vocab_size": 96}, target.config)
    weights = load_weights(tmp_path / "one")
    files = save_weights({k: v.to(torch.bfloat16) for k, v in weights.items()}, tmp_path / "one", max_shard_bytes=20_000)
    (tmp_path / "one" / "model.safetensors").unlink()
    assert len([f for f in files if f.suffix == ".safetensors"]) >= 2 and all(f.stat().st_size <= 40_000 for f in files)
    loaded, _ = load_heads(tmp_path / "one", target)  # upcast to the target's dtype
    assert loaded.fc.weight.dtype == target.dtype != torch.bfloat16
    assert torch.equal(loaded.fc.weight, weights["fc.weight"].to(torch.bfloat16).to(target.dtype))
    from safetensors.torch import load_file

    from specdec.train.trainers.heads import export_artifact

    export_artifact(tmp_path / "one", tmp_path / "vllm", "vllm")  # the EAGLE layout, from the shards
    assert torch.equal(load_file(str(tmp_path / "vllm" / "model.safetensors"))["fc.weight"], weights["fc.weight"].to(torch.bfloat16))


def test_a_tensor_larger_than_a_shard_is_stored_in_row_blocks_and_joined_on_load(tmp_path):
    from safetensors import safe_open

    from specdec.models.artifacts import PART, load_weights, save_weights

    g = torch.Generator().manual_seed(0)
    state = {"lm_head.weight": torch.randn(301, 40, generator=g).to(torch.bfloat16), "norm.weight": torch.randn(40, generator=g)}
    files = save_weights(state, tmp_path / "a", max_shard_bytes=8_000)  # the head is 24 kB: three blocks at least
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) >= 3 and all(f.stat().st_size <= 8_000 + 1_000 for f in shards)  # the header on top
    stored = set()
    for f in shards:
        with safe_open(str(f), "pt") as fh:
            stored |= set(fh.keys())
    assert "lm_head.weight" not in stored and any(PART in k for k in stored)
    loaded = load_weights(tmp_path / "a")
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], state[k]) for k in state)


def test_a_shipped_head_keeps_its_draft_vocabularys_target_ids_exact(tmp_path):
    """Shipping casts weights to bf16, which holds integers exactly only up to 256: a reduced vocabulary's
    target ids (Gemma's run to 262,143) must stay integers, or the head proposes the wrong tokens."""
    from conftest import tiny_llama

    from specdec.models.artifacts import load_weights
    from specdec.models.head_artifacts import save_heads
    from specdec.models.interop import Eagle3Head, layer_config
    from specdec.train.ship import _ship_member

    target = tiny_llama()
    ids = torch.tensor([3, 257, 1001, 70_001, 262_143])
    head = Eagle3Head(layer_config(target.config), [0, 1, 1], vocab=262_144, draft_ids=ids)
    save_heads(head, tmp_path / "built", {"vocab_size": 262_144}, target.config)
    _ship_member(tmp_path / "built", tmp_path / "shipped", 15 * 2**20)
    shipped = load_weights(tmp_path / "shipped")
    assert not shipped["draft_ids"].is_floating_point() and torch.equal(shipped["draft_ids"], ids)
    assert shipped["fc.weight"].dtype == torch.bfloat16  # the weights are the ones cast


def fake_family(root: Path) -> Path:
    from conftest import save_tiny_lm, tiny_tokenizer

    save_tiny_lm(root / "pycode" / "target", tiny_tokenizer())
    (root / "pycode" / "target" / "metrics.json").write_text("{}")
    return root / "pycode"


def test_families_resolve_members(tmp_path, monkeypatch):
    """Bare member names resolve in the default family (Gemma 3 270M: drafters shipped with specdec, its
    target converted from its package); FAMILY/MEMBER in another family, shipped or built."""
    from specdec.models import artifacts, loading

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(artifacts, "SHIPPED_DIR", tmp_path / "families")
    (tmp_path / "families" / "gemma3-270m" / "eagle3").mkdir(parents=True)
    assert artifacts.family_dir() == tmp_path / "families" / "gemma3-270m"
    assert loading.resolve_source("eagle3") == str(tmp_path / "families" / "gemma3-270m" / "eagle3")
    with pytest.raises(SpecdecError, match="does not ship 'medusa'"):
        artifacts.resolve_member("medusa")
    assert loading.resolve_source("tiny-stdlib/draft") == str(tmp_path / "home" / "tiny-stdlib" / "draft")
    assert artifacts.family_dir("pycode") == tmp_path / "home" / "pycode"
    fam = fake_family(tmp_path / "families")
    assert artifacts.family_dir("pycode") == fam
    assert loading.resolve_source("pycode") == str(fam / "target")
    with pytest.raises(SpecdecError, match="pycode family .* does not ship 'medusa'"):
        artifacts.resolve_member("pycode/medusa")


def test_drafters_train_with_every_core(tmp_path, monkeypatch):
    """The recipe hands its trainers a placement with every core: models.loading would otherwise keep the
    small target on one thread for the whole drafter stage."""
    from specdec.models.loading import Placement
    from specdec.train import recipe

    seen = []

    def fake(name):
        def train(*args, placement=None, **kwargs):
            seen.append((name, placement))
            return {}
        return train

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    monkeypatch.setattr(recipe, "load_texts", lambda files: ["x = 1\n"] * 4)
    monkeypatch.setattr(recipe, "cut_code_prompts", lambda *a: ["x"])
    monkeypatch.setattr(recipe, "self_distill", lambda *a, **k: 0)
    for name in ("train_draft", "train_acceptance", "train_heads"):
        monkeypatch.setattr(recipe, name, fake(name))
    recipe.build_drafters(tmp_path, [tmp_path / "data.jsonl"], 1.0, 0, arch="layers=1,hidden=32,heads=2",
                          placement=Placement(device="cpu", threads=os.cpu_count()))
    assert len(seen) == 6 and all(p is not None and p.threads == os.cpu_count() for _, p in seen)


@pytest.mark.slow
def test_gpu_recipe_script_in_two_runs_on_a_cpu(tmp_path):
    """scripts/gpu-recipe as a GPU machine runs it, on a toy recipe and a CPU: the target stage ships
    the target and packs it, the pieces unpack into a fresh families folder, the rest stage starts from
    that target on a bare SPECDEC_HOME, and the shipped family decodes with its draft as without it."""
    import subprocess
    import sys

    from conftest import invoke

    recipe = tiny_recipe(tmp_path, small_tree(tmp_path / "src"),
                         drafters={"arch": "layers=1,hidden=32,heads=2,ffn=64"},
                         export={"members": ["target", "draft", "eagle"], "max_file_mb": 15, "max_total_mb": 60})
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu-recipe"
    families = tmp_path / "families"
    for stage in ("target", "rest"):
        out = tmp_path / f"out-{stage}"
        env = {**os.environ, "SPECDEC_HOME": str(tmp_path / f"home-{stage}")}  # each device machine starts bare
        run = subprocess.run([sys.executable, str(script), "--stage", stage, "--recipe", str(recipe), "--device", "cpu",
                              "--families", str(families), "--out", str(out)], capture_output=True, text=True, env=env, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
        pieces = sorted(out.glob("pycode-test.tar.*"))
        assert pieces and all(p.stat().st_size <= 15 * 2**20 for p in pieces)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["pieces"] == [p.name for p in pieces]
        shutil.rmtree(families, ignore_errors=True)
        families.mkdir()
        subprocess.run(f"cat {' '.join(str(p) for p in pieces)} | tar -xf - -C {families}", shell=True, check=True)
    fam = families / "pycode-test"
    assert {p.name for p in fam.iterdir() if p.is_dir()} == {"target", "draft", "eagle"}
    card = (fam / "README.md").read_text()
    assert "--stage target" in card and "--stage rest" in card and "medusa" in card.split("not shipped")[1].split("\n")[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join((fam / "prompts.jsonl").read_text().splitlines(keepends=True)[:2]))
    outs = {}
    for drafter in ("ar", str(fam / "draft"), str(fam / "eagle")):
        dst = tmp_path / f"{Path(drafter).name}.jsonl"
        res = invoke(["decode", "--in", prompts, "--out", dst, "--target", fam / "target", "--drafter", drafter,
                      "--max-new-tokens", "16", "--device", "cpu"])
        assert res.exit_code == 0, res.output
        outs[drafter] = [json.loads(line)["completion"] for line in dst.read_text().splitlines()]
    assert len({tuple(v) for v in outs.values()}) == 1
