"""``export --to gguf``: a published EAGLE-3 head as llama.cpp's ``eagle3`` draft file. The file holds
the architecture, metadata and tensors llama.cpp's loader asks for (names, shapes, types), the target's
tokenizer, the draft vocabulary's ``d2t`` as absolute target ids; the forward llama.cpp's EAGLE-3 graph
computes from the file (written out here in torch: pairwise RoPE on the permuted q/k, the 2H entry,
the pre-norm state fed back) gives specdec's head's logits; what llama.cpp cannot hold is one
``error:`` line. With SPECDEC_LLAMACPP_BUILD pointing to a llama.cpp build, the slow test runs it."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import invoke, tiny_tokenizer
from gguf_files import write_tiny_llama_gguf
from specdec.models.artifacts import tokenizer_fingerprint
from specdec.models.gguf_export import KEY_NORM_BEFORE_FC, KEY_NORM_BEFORE_RESIDUAL, KEY_TARGET_HIDDEN_SIZE, KEY_TARGET_LAYERS
from specdec.models.head_artifacts import build_heads, load_heads, save_heads
from specdec.models.interop import build_published_eagle, layer_config
from specdec.models.loading import load_target
from test_interop import _perturb

gguf = pytest.importorskip("gguf")

LINES = ["def add(a, b):\n    return a + b\n", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
         "for i in range(10):\n    print(i * i)\n", "import os\nimport sys\npath = os.path.join('a', 'b')\n"]
# what llama.cpp's loader reads from an eagle3 file (src/llama-model.cpp load_hparams, src/models/eagle3.cpp)
REQUIRED_KEYS = ("general.architecture", "eagle3.context_length", "eagle3.embedding_length", "eagle3.block_count",
                 "eagle3.feed_forward_length", "eagle3.attention.head_count", "eagle3.attention.head_count_kv",
                 "eagle3.attention.key_length", "eagle3.attention.value_length", "eagle3.attention.layer_norm_rms_epsilon",
                 "eagle3.rope.freq_base", "eagle3.rope.dimension_count", KEY_TARGET_LAYERS, KEY_TARGET_HIDDEN_SIZE,
                 KEY_NORM_BEFORE_RESIDUAL, KEY_NORM_BEFORE_FC, "tokenizer.ggml.model", "tokenizer.ggml.tokens")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A tiny random Llama written as a GGUF file (4 layers: EAGLE-3 fuses three), training text, and a
    SPECDEC_HOME of its own (the file is converted there once)."""
    root = tmp_path_factory.mktemp("gguf-export")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_HOME", str(root / "home"))
        target_file = write_tiny_llama_gguf(root / "target.gguf", tiny_tokenizer(), layers=4)
        with open(root / "data.jsonl", "w") as fh:
            for i in range(80):
                fh.write(json.dumps({"text": "".join(LINES[(i + j) % 4] for j in range(3))}) + "\n")
        target, tok, _ = load_target(target_file)
        yield root, target_file, target.double(), tok


@pytest.fixture(scope="module")
def trained(env):
    """The user's path: train-heads --kind eagle --eagle3 --layout published with a reduced draft vocabulary."""
    root, target_file, _, _ = env
    res = invoke(["train-heads", "--kind", "eagle", "--eagle3", "--layout", "published", "--target", target_file, "--data",
                  root / "data.jsonl", "--out", root / "e3", "--max-steps", "4", "--batch-size", "4", "--seq-len", "32",
                  "--unroll", "2", "--draft-vocab", "64", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    return root / "e3"


def _artifact(env, name, head):
    """A head artifact as train-heads writes it, its training config naming the GGUF target."""
    root, target_file, target, tok = env
    out = root / name
    save_heads(head, out, tokenizer_fingerprint(tok), target.config)
    (out / "training_config.yaml").write_text(yaml.safe_dump({"target": str(target_file)}))
    return out


def _eagle3(env, name, seed=0, layer=None, **flags):
    _, _, target, _ = env
    torch.manual_seed(seed)
    hp = {"layout": "published", "eagle3": True, "feature_layers": [1, 2, 3], **flags}
    if layer is not None:
        hp["layer"] = layer
    head = build_published_eagle(target, hp).attach(target, init_from_lm_head=True)
    return _artifact(env, name, _perturb(head, seed, scale=0.2, keep=()))


def _export(art, out, *extra):
    res = invoke(["export", art, "--to", "gguf", "--out", out, *extra])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == str(out)
    return out


def _read(path):
    reader = gguf.GGUFReader(str(path))
    fields = {name: f for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    return reader, fields, {t.name: t for t in reader.tensors}


def _value(field):
    return field.contents()


def _permute(w, heads):
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# the file: what llama.cpp's loader reads


def test_a_trained_head_exports_with_the_metadata_tensors_and_vocabulary_llama_cpp_reads(env, trained):
    root, target_file, target, _ = env
    cfg = json.loads((trained / "config.json").read_text())
    res = invoke(["export", trained, "--to", "gguf"])  # default: SRC.gguf beside it, the target found from its training
    assert res.exit_code == 0, res.output
    path = Path(res.stdout.strip())
    assert path == root / "e3.gguf" and path.is_file()
    reader, fields, tensors = _read(path)

    assert _value(fields["general.architecture"]) == "eagle3"
    assert not [k for k in REQUIRED_KEYS if k not in fields]
    layer = cfg["layer"]
    h, nh, nkv, d = layer["hidden_size"], layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    expect = {"eagle3.block_count": 1, "eagle3.embedding_length": h, "eagle3.feed_forward_length": layer["intermediate_size"],
              "eagle3.attention.head_count": nh, "eagle3.attention.head_count_kv": nkv, "eagle3.attention.key_length": d,
              "eagle3.attention.value_length": d, "eagle3.rope.dimension_count": d, "eagle3.rope.freq_base": 10000.0,
              "eagle3.context_length": layer["max_position_embeddings"], KEY_TARGET_LAYERS: cfg["feature_layers"],
              KEY_TARGET_HIDDEN_SIZE: cfg["target_hidden_size"], KEY_NORM_BEFORE_RESIDUAL: False, KEY_NORM_BEFORE_FC: False,
              "eagle3.vocab_size": cfg["vocab_size"]}
    assert {k: _value(fields[k]) for k in expect} == expect
    assert fields[KEY_TARGET_LAYERS].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]  # llama.cpp: int32 array
    assert fields[KEY_NORM_BEFORE_FC].types == [gguf.GGUFValueType.BOOL]
    assert _value(fields["eagle3.attention.layer_norm_rms_epsilon"]) == pytest.approx(layer["rms_norm_eps"])

    # the target's tokenizer, field for field
    _, theirs, _ = _read(target_file)
    tok_keys = sorted(k for k in theirs if k.startswith("tokenizer."))
    assert sorted(k for k in fields if k.startswith("tokenizer.")) == tok_keys
    for k in tok_keys:
        assert fields[k].types == theirs[k].types and _value(fields[k]) == _value(theirs[k]), k

    # every tensor: name, GGUF shape {in, out}, type
    n = cfg["draft_vocab_size"]
    th = cfg["target_hidden_size"]
    ff = layer["intermediate_size"]
    F16, F32, I64 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I64
    shapes = {"fc.weight": ([3 * th, h], F16), "blk.0.attn_norm.weight": ([h], F32), "blk.0.attn_norm_2.weight": ([h], F32),
              "blk.0.attn_q.weight": ([2 * h, nh * d], F16), "blk.0.attn_k.weight": ([2 * h, nkv * d], F16),
              "blk.0.attn_v.weight": ([2 * h, nkv * d], F16), "blk.0.attn_output.weight": ([nh * d, h], F16),
              "blk.0.ffn_norm.weight": ([h], F32), "blk.0.ffn_gate.weight": ([h, ff], F16), "blk.0.ffn_up.weight": ([h, ff], F16),
              "blk.0.ffn_down.weight": ([ff, h], F16), "output_norm.weight": ([h], F32), "output.weight": ([h, n], F16),
              "d2t": ([n], I64)}
    assert {k: ([int(x) for x in t.shape], t.tensor_type) for k, t in tensors.items()} == shapes

    # the draft vocabulary: absolute target ids in ascending order, the LM head's rows in that order
    from specdec.models.artifacts import load_weights

    w = load_weights(trained)
    ids = w["draft_ids"].long()
    order = torch.argsort(ids)
    d2t = np.asarray(tensors["d2t"].data)
    assert d2t.dtype == np.int64 and d2t.tolist() == ids[order].tolist()
    assert len(set(d2t.tolist())) == n and 0 <= d2t.min() and d2t.max() < cfg["vocab_size"]
    out = torch.from_numpy(np.asarray(tensors["output.weight"].data).astype(np.float32))
    assert torch.allclose(out, w["lm_head.weight"][order].float(), atol=1e-3)
    # q and k rows from rotate-half to llama.cpp's pairwise RoPE, per head
    q = torch.from_numpy(np.asarray(tensors["blk.0.attn_q.weight"].data).astype(np.float32))
    k = torch.from_numpy(np.asarray(tensors["blk.0.attn_k.weight"].data).astype(np.float32))
    assert torch.allclose(q, _permute(w["layers.0.self_attn.q_proj.weight"].float(), nh), atol=1e-3)
    assert torch.allclose(k, _permute(w["layers.0.self_attn.k_proj.weight"].float(), nkv), atol=1e-3)
    assert not torch.allclose(q, w["layers.0.self_attn.q_proj.weight"].float(), atol=1e-3)


# ---------------------------------------------------------------------------------------------
# the forward llama.cpp computes from the file = specdec's head


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope_pairs(x, pos, base, factors=None):
    """llama.cpp's LLAMA_ROPE_TYPE_NORM: dimensions (2i, 2i+1) rotate at base^(-2i/d) (divided by rope_freqs)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    if factors is not None:
        inv = inv / factors
    ang = pos[:, None].double() * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
    return out


class LlamaCppEagle3:
    """The computation of llama.cpp's eagle3 graphs (src/models/eagle3.cpp), from a GGUF file, in float64:
    the encoder g = fc([norm](target layer inputs)), and the decoder over entries (token, g) at positions,
    each attending to itself and the entries before it, returning (pre-norm state fed back, logits over the
    target vocabulary)."""

    def __init__(self, path, target_embedding):
        _, fields, tensors = _read(path)
        self.kv = {k: _value(f) for k, f in fields.items() if not k.startswith("tokenizer.")}
        self.t = {}
        for name, t in tensors.items():
            a = np.asarray(t.data)
            self.t[name] = torch.from_numpy(a.copy()) if a.dtype == np.int64 else torch.from_numpy(a.astype(np.float64))
        self.embed = self.t.get("token_embd.weight", target_embedding)
        self.vocab = len(fields["tokenizer.ggml.tokens"].data)

    def encode(self, hidden_states):
        feats = torch.cat([hidden_states[i] for i in self.kv[KEY_TARGET_LAYERS]], -1).double()
        if self.kv[KEY_NORM_BEFORE_FC]:
            feats = _rms(feats, self.t["enc.output_norm.weight"], self.kv["eagle3.attention.layer_norm_rms_epsilon"])
        return feats @ self.t["fc.weight"].T

    def decode(self, tokens, g, pos):
        t, kv = self.t, self.kv
        eps = kv["eagle3.attention.layer_norm_rms_epsilon"]
        nh, nkv, d = kv["eagle3.attention.head_count"], kv["eagle3.attention.head_count_kv"], kv["eagle3.attention.key_length"]
        n = len(tokens)
        e = _rms(self.embed[tokens].double(), t["blk.0.attn_norm.weight"], eps)
        gn = _rms(g, t["blk.0.attn_norm_2.weight"], eps)
        x = torch.cat([e, gn], -1)
        q = (x @ t["blk.0.attn_q.weight"].T).view(n, nh, d)
        k = (x @ t["blk.0.attn_k.weight"].T).view(n, nkv, d)
        v = (x @ t["blk.0.attn_v.weight"].T).view(n, nkv, d)
        factors = t.get("rope_freqs.weight")
        q = _rope_pairs(q, pos, kv["eagle3.rope.freq_base"], factors)
        k = _rope_pairs(k, pos, kv["eagle3.rope.freq_base"], factors)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, nh * d) @ t["blk.0.attn_output.weight"].T
        res = o + (gn if kv[KEY_NORM_BEFORE_RESIDUAL] else g)
        y = _rms(res, t["blk.0.ffn_norm.weight"], eps)
        out = res + (torch.nn.functional.silu(y @ t["blk.0.ffn_gate.weight"].T) * (y @ t["blk.0.ffn_up.weight"].T)) @ t["blk.0.ffn_down.weight"].T
        logits = _rms(out, t["output_norm.weight"], eps) @ t["output.weight"].T
        if "d2t" in t:
            full = torch.full((n, self.vocab), float("-inf"), dtype=torch.float64)
            full[:, t["d2t"]] = logits
            logits = full
        return out, logits


def _f16_head(art, target):
    """The artifact's head in float64 with its matrices rounded to float16, as the file holds them."""
    head, _ = load_heads(art, target)
    head = head.double()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.copy_(p.half().double())
    return head


@pytest.mark.parametrize("variant", ["trained", "full-vocab", "norm-before-fc+residual", "own-embedding", "llama3-rope"])
def test_llama_cpps_eagle3_forward_on_the_file_gives_the_heads_logits(env, trained, variant):
    root, target_file, target, tok = env
    if variant == "trained":
        art = trained
    elif variant == "full-vocab":
        art = _eagle3(env, "v-full", seed=1)
    elif variant == "norm-before-fc+residual":
        art = _eagle3(env, "v-norms", seed=2, norm_before_fc=True, norm_before_residual=True)
    elif variant == "own-embedding":
        art = _eagle3(env, "v-embed", seed=3, own_embed=True)
    else:
        layer = layer_config(target.config)
        layer["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        art = _eagle3(env, "v-llama3", seed=4, layer=layer)
    path = _export(art, root / f"{art.name}-check.gguf")
    tensors = _read(path)[2]
    assert ("d2t" in tensors) == (variant == "trained")
    assert ("enc.output_norm.weight" in tensors) == (variant == "norm-before-fc+residual")
    assert ("token_embd.weight" in tensors) == (variant == "own-embedding")
    assert ("rope_freqs.weight" in tensors) == (variant == "llama3-rope")

    head = _f16_head(art, target)
    ids = tok("".join(LINES), return_tensors="pt")["input_ids"][:, :40]
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        chain = head.chain_logits(hs, ids, 2)[:, 0]  # [2, T, V]: step u at start s drafts token s+2+u
    cpp = LlamaCppEagle3(path, target.get_input_embeddings().weight.detach().double())
    g = cpp.encode(hs)[0]
    n = ids.shape[1] - 1
    # llama.cpp's decoder entry at position P: (token P+1, g P) -- common/speculative.cpp
    out0, logits0 = cpp.decode(ids[0, 1:], g[:n], torch.arange(n))
    mine = chain[0, :n]
    assert torch.equal(torch.isinf(logits0), torch.isinf(mine))
    finite = torch.isfinite(mine)
    # float64 on both sides but specdec's norms and RoPE tables in float32: agreement to ~1e-6
    assert (logits0[finite] - mine[finite]).abs().max() < 1e-4
    assert torch.equal(logits0.argmax(-1), mine.argmax(-1))
    # the next draft step: the pre-norm state fed back, one position on, the drafted token as input
    s = n - 2
    _, logits1 = cpp.decode(torch.cat([ids[0, 1:s + 2], ids[0, s + 2:s + 3]]), torch.cat([g[:s + 1], out0[s:s + 1]]),
                            torch.arange(s + 2))
    mine1 = chain[1, s]
    finite = torch.isfinite(mine1)
    assert (logits1[-1][finite] - mine1[finite]).abs().max() < 1e-4
    assert torch.isinf(logits1[-1][~finite]).all()


# ---------------------------------------------------------------------------------------------
# the target's file, explicit


def test_a_head_whose_target_is_no_gguf_file_takes_target(env, tmp_path):
    root, target_file, target, tok = env
    art = _eagle3(env, "no-gguf-target", seed=5)
    (art / "training_config.yaml").write_text(yaml.safe_dump({"target": str(tmp_path / "elsewhere")}))
    line = _one_error_line(invoke(["export", art, "--to", "gguf", "--out", tmp_path / "x.gguf"]), code=2)
    assert "--target" in line
    path = _export(art, tmp_path / "x.gguf", "--target", target_file)
    assert _value(_read(path)[1]["general.architecture"]) == "eagle3"
    # a target of another width is refused
    other = write_tiny_llama_gguf(tmp_path / "wide.gguf", tiny_tokenizer(), layers=4, hidden=64)
    assert "hidden size 64" in _one_error_line(invoke(["export", art, "--to", "gguf", "--out", tmp_path / "y.gguf",
                                                       "--target", other]), code=2)
    assert "--to gguf" in _one_error_line(invoke(["export", art, "--to", "speculators", "--target", target_file]), code=2)


# ---------------------------------------------------------------------------------------------
# what is refused, in one line


def _one_error_line(res, code=2):
    assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    return lines[0]


def test_heads_llama_cpp_cannot_run_are_refused_in_one_line(env, tmp_path):
    _, _, target, _ = env
    torch.manual_seed(0)
    native = _artifact(env, "r-native", build_heads("eagle", target, {"feature_layers": [1, 2, 3]}).attach(target))
    assert "--layout published" in _one_error_line(invoke(["export", native, "--to", "gguf", "--out", tmp_path / "a.gguf"]))
    eagle1 = _artifact(env, "r-eagle1", build_published_eagle(target, {"layout": "published"}).attach(target))
    assert "EAGLE-1" in _one_error_line(invoke(["export", eagle1, "--to", "gguf", "--out", tmp_path / "b.gguf"]))
    fc_norm = _eagle3(env, "r-fc-norm", fc_norm=True)
    assert "fc_norm" in _one_error_line(invoke(["export", fc_norm, "--to", "gguf", "--out", tmp_path / "c.gguf"]))
    both = _eagle3(env, "r-both", norm_output=True, logits_norm=False)
    line = _one_error_line(invoke(["export", both, "--to", "gguf", "--out", tmp_path / "d.gguf"]))
    assert "norm_output" in line and "LM head without its norm" in line
    medusa = _artifact(env, "r-medusa", build_heads("medusa", target, {"num_heads": 2}).attach(target))
    assert "'medusa'" in _one_error_line(invoke(["export", medusa, "--to", "gguf", "--out", tmp_path / "e.gguf"]))
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*partial"))


# ---------------------------------------------------------------------------------------------
# llama.cpp itself (a build's bin/llama-speculative-simple), when one is at hand


@pytest.mark.slow
def test_llama_cpp_drafts_what_the_head_proposes(env, trained, tmp_path):
    """llama.cpp loads the exported draft beside the target's GGUF file and, greedy, drafts (draft-eagle3)
    the tokens specdec's head proposes on the same context, with the same probabilities (its top-10
    renormalised), and the target token it verifies is the target's greedy one. Set
    SPECDEC_LLAMACPP_BUILD to a llama.cpp build folder (cmake --build BUILD --target
    llama-speculative-simple); skipped otherwise."""
    build = os.environ.get("SPECDEC_LLAMACPP_BUILD")
    if not build:
        pytest.skip("SPECDEC_LLAMACPP_BUILD is not set")
    binary = Path(build) / "bin" / "llama-speculative-simple"
    if not binary.is_file():
        pytest.skip(f"no {binary}")
    root, target_file, target, tok = env
    draft = _export(trained, tmp_path / "draft.gguf")
    prompt = LINES[0] + "class Point:"  # tokenised alike by llama.cpp and the tokenizer here (no BOS: a gpt2 vocabulary)
    cmd = [str(binary), "-m", str(target_file), "-md", str(draft), "--spec-type", "draft-eagle3", "--spec-draft-n-max", "3",
           "-p", prompt, "-n", "8", "--temp", "0", "--top-k", "1", "--seed", "1", "-t", "2", "-c", "256", "-lv", "5"]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    assert "EAGLE3 using d2t mapping" in log and int(re.search(r"n_drafted\s*=\s*(\d+)", log).group(1)) > 0
    first = log[: log.index("accepted ")]  # the first round's drafts, before its verification
    drafts: dict[int, list[tuple[int, float]]] = {}
    for _, pos, tid, p in re.findall(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(\d+) \(\s*([\d.]+)\)", first):
        drafts.setdefault(int(pos), []).append((int(tid), float(p)))
    assert sorted(drafts) == [0, 1, 2]
    verified = int(re.search(r"the last target token is: \((\d+)\)", log).group(1))

    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    full = torch.tensor([ids + [drafts[0][0][0], drafts[1][0][0]]])  # llama.cpp feeds its own drafts back
    head, _ = load_heads(trained, target)
    with torch.no_grad():
        hs = target(input_ids=full, output_hidden_states=True).hidden_states
        chain = head.chain_logits(hs, full, 3)[:, 0]
        assert verified == int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
    s = len(ids) - 2  # llama.cpp's first draft entry: (the prompt's last token, the features at the one before)
    for u in range(3):
        top = torch.topk(chain[u, s], 10)
        probs = torch.softmax(top.values.double(), -1)
        mine = [(int(i), float(q)) for i, q in zip(top.indices[:3], probs[:3])]
        assert [t for t, _ in drafts[u]] == [t for t, _ in mine], u
        assert all(abs(a - b) < 0.01 for (_, a), (_, b) in zip(drafts[u], mine)), u
