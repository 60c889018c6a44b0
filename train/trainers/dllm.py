"""Train masked-diffusion LMs: adapt an AR checkpoint (or start from a config), and dParallel distillation.

A specdec dLLM is a stock Llama checkpoint plus a MASK token and config keys (``specdec_kind:
dllm``, ``mask_token_id``, ``dllm_attention``, ``dllm_block_size``, ``token_shift``). Adapting an
AR model keeps its token shift (the logit at i-1 predicts token i), so the network keeps doing
what it was trained for and only learns to read MASK tokens and look ahead (Dream, Fast-dLLM v2).

Both objectives train with specdec's one loop (``specdec.train.loop.run_training``); each has a
collate function that draws its masks on the CPU (seeded) and a loss that only runs the model:
- masked CE (LLaDA/MDLM): t ~ U(0,1), p = (1-eps) t + eps, answer tokens masked with prob p,
  loss = sum(CE/p over masked) / (B*L), prompts never masked, each example also seen with the
  complementary mask so every token is supervised once;
- certainty forcing (dParallel): on the model's own static one-token-per-step greedy responses,
  CE plus an entropy penalty on masked tokens it already predicts correctly, which makes
  threshold decoders commit earlier. The responses answer code prompts cut from the training
  texts the way the recipe cuts its held-out prompts, at the length and block size the model is
  decoded with, so the distillation sees the distribution it is judged on.
"""

from __future__ import annotations

import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.decode.diffusion.generator import DiffusionGenerator
from specdec.decode.engine.types import GenRequest
from specdec.models.artifacts import read_config, tokenizer_fingerprint, write_json
from specdec.models.dllm import DllmSpec, dllm_attention, encode_prompt, model_mask
from specdec.models.errors import SpecdecError, UsageError
from specdec.models.loading import apply_threads
from specdec.train.loop import StepSeeded
from specdec.train.prompts import code_prompts
from specdec.train.settings import DllmSettings, check_by_name

# every linear layer but the output head, whatever the architecture calls them (peft resolves it)
LORA_TARGETS = "all-linear"


@dataclass
class DllmTrainConfig:
    block_size: int = 32
    attention: str = "block"  # "block" (block diffusion) or "bidirectional"
    seq_len: int = 128
    batch_size: int = 8
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_steps: int = 500
    budget_minutes: float | None = None
    eps: float = 1e-3
    complementary: bool = True
    mixed_precision: str = "auto"  # autocast: bf16 where the hardware has it natively, else fp32 (train.loop.resolve_precision)
    heldout_fraction: float = 0.05
    eval_batches: int = 4
    seed: int = 0
    mask_token: str = "<|mask|>"
    lora: bool = False
    lora_rank: int = 128
    lora_alpha: int = 128
    certainty_forcing: bool = False
    cf_prompts: int = 256  # code prompts (cut from the training texts) whose own responses are distilled
    cf_pair_prompts: int = 64  # plus this many prompts of prompt/completion pairs (list tasks)
    cf_prompt_tokens: tuple[int, int] = (64, 256)  # code prompt length range, as the recipe's held-out prompts
    cf_gen_length: int = 128  # the length and block size the model is benchmarked at
    cf_decode_batch: int = 16
    # "prefix": the K/V of the prompt and finished blocks are reused. Under block attention that is the same
    # computation (only the rounding of differently shaped matmuls differs) at a fraction of the cost.
    cf_cache: str = "none"
    cf_generation_share: float = 0.5  # under a budget, self-generation stops after this share of it
    cf_temperature: float = 0.5  # entropy is measured on softmax(logits / T)
    cf_entropy_weight: float = 2.0
    progress: bool = True
    # checkpoints under OUT/checkpoints every N optimizer steps (0: only at the end; None: none, nothing to resume)
    checkpoint_every: int | None = None

    def __post_init__(self):
        check_by_name(DllmSettings, self)  # block size, attention, ...: where they are declared (train.settings)
        if self.seq_len < 2 or self.batch_size < 1:
            raise SpecdecError("sequence length and batch size must be positive")


@dataclass
class Example:
    ids: list[int]  # prompt + answer (+ EOS padding), or a plain-text chunk
    prompt_len: int  # 0 for plain text: a prompt/answer split is drawn each time it is used


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def read_training_data(texts_or_files: Iterable[str | Path]) -> tuple[list[str], list[tuple[str, str]]]:
    """Plain texts and (prompt, completion) pairs from literal strings, JSONL files or text files."""
    from datasets import load_dataset

    texts: list[str] = []
    pairs: list[tuple[str, str]] = []
    for item in texts_or_files:
        path = _as_existing_file(item)
        if path is None:
            texts.append(str(item))
            continue
        if path.suffix in (".jsonl", ".json"):
            for row in load_dataset("json", data_files=str(path), split="train"):
                if row.get("prompt") is not None and row.get("completion") is not None:
                    pairs.append((row["prompt"], row["completion"]))
                elif row.get("text") or row.get("prompt"):
                    texts.append(row.get("text") or row["prompt"])
        else:
            texts.extend(row["text"] for row in load_dataset("text", data_files=str(path), sample_by="document", split="train"))
    return texts, pairs


def _as_existing_file(item) -> Path | None:
    if isinstance(item, Path):
        if not item.is_file():
            raise SpecdecError(f"no such data file: {item}")
        return item
    if "\n" in item or len(item) > 4096:
        return None
    try:
        path = Path(item)
        return path if path.is_file() else None
    except OSError:
        return None


def text_examples(tokenizer, texts: list[str], seq_len: int, eos_id: int) -> list[Example]:
    """Blocks of the texts' tokens (EOS after each), cut as every trainer's are (``train.data.cut_blocks``: each
    starts with what the tokenizer puts in front of a prompt; a drawn prompt, at least one token, holds a BOS)."""
    from specdec.train.data import block_prefix, cut_blocks

    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id])
    blocks = cut_blocks(torch.tensor(stream, dtype=torch.long), seq_len, block_prefix(tokenizer))
    return [Example(ids, 0) for ids in blocks.tolist()]


def pair_examples(tokenizer, pairs: list[tuple[str, str]], seq_len: int, eos_id: int) -> list[Example]:
    """Prompt + completion + EOS, padded with EOS to seq_len: the model learns to fill the canvas tail with EOS.
    A long prompt keeps its end and the tokens the tokenizer puts in front of it (its BOS)."""
    from specdec.train.data import block_prefix

    prefix = block_prefix(tokenizer)
    out = []
    for prompt, completion in pairs:
        p = encode_prompt(tokenizer, prompt)
        n = len(prefix) if p[: len(prefix)] == prefix else 0
        body = p[n:]
        p = p[:n] + body[max(len(body) - max(seq_len // 2 - n, 0), 0) :]
        a = (tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos_id])[: seq_len - len(p)]
        out.append(Example(p + a + [eos_id] * (seq_len - len(p) - len(a)), len(p)))
    return out


def sample_batch(examples: list[Example], batch_size: int, rng: random.Random) -> tuple[Tensor, Tensor]:
    rows = [examples[rng.randrange(len(examples))] for _ in range(batch_size)]
    tokens = torch.tensor([ex.ids for ex in rows])
    # Plain text gets a random prompt so answers start everywhere, as they do at decode time.
    prompt_len = torch.tensor([ex.prompt_len or rng.randint(1, len(ex.ids) // 2) for ex in rows])
    return tokens, prompt_len


# --------------------------------------------------------------------------------------------
# Objectives
# --------------------------------------------------------------------------------------------


def dllm_logits(model, tokens: Tensor, prompt_len: Tensor, spec: DllmSpec, valid: Tensor | None = None) -> Tensor:
    """Logits aligned with tokens: row i predicts token i (the token shift undone)."""
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
    allowed = dllm_attention(valid, prompt_len.to(tokens.device) - spec.shift, spec.attention, spec.block_size)
    logits = model(input_ids=tokens, attention_mask=model_mask(model, allowed)).logits
    if spec.token_shift:
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # position 0 is always prompt
    return logits


class MaskedDiffusionCollate(StepSeeded):
    """Examples -> a noised batch: the masks the loss needs, drawn on the CPU from generators seeded per
    micro-batch (a resumed run draws the same masks)."""

    def __init__(self, spec: DllmSpec, cfg: DllmTrainConfig, seed: int):
        super().__init__(seed)
        self.spec, self.cfg = spec, cfg

    def __call__(self, rows: list[Example]) -> dict[str, Tensor]:
        # LLaDA / MDLM masked CE with the 1/p weighting; Fast-dLLM v2 complementary masks.
        cfg = self.cfg
        rng, gen = self.draw()
        tokens = torch.tensor([ex.ids for ex in rows])
        # Plain text gets a random prompt so answers start everywhere, as they do at decode time.
        prompt_len = torch.tensor([ex.prompt_len or rng.randint(1, len(ex.ids) // 2) for ex in rows])
        b, length = tokens.shape
        answer = torch.arange(length)[None] >= prompt_len[:, None]
        p = (1 - cfg.eps) * torch.rand(b, generator=gen) + cfg.eps
        masked = (torch.rand(b, length, generator=gen) < p[:, None]) & answer
        views = [(masked, p)]
        if cfg.complementary:
            views.append((~masked & answer, (1 - p).clamp(min=cfg.eps)))
        masks = torch.cat([m for m, _ in views])
        targets = tokens.repeat(len(views), 1)
        return {
            "noisy": torch.where(masks, self.spec.mask_token_id, targets),
            "targets": targets,
            "prompt_len": prompt_len.repeat(len(views)),
            "weight": masks / torch.cat([q for _, q in views])[:, None],
            "answer_tokens": answer.sum() * len(views),
        }


def masked_diffusion_loss(model, batch: dict[str, Tensor], spec: DllmSpec) -> Tensor:
    logits = dllm_logits(model, batch["noisy"], batch["prompt_len"], spec)
    ce = F.cross_entropy(logits.float().transpose(1, 2), batch["targets"], reduction="none")
    return (ce * batch["weight"]).sum() / batch["answer_tokens"]


@torch.no_grad()
def heldout_masked_ce(model, examples: list[Example], spec: DllmSpec, cfg: DllmTrainConfig) -> float | None:
    """Mean CE per masked token on held-out examples, with fixed masks (comparable across runs)."""
    if not examples:
        return None
    rng, gen = random.Random(1234), torch.Generator().manual_seed(1234)
    total, count = 0.0, 0
    model.eval()
    for _ in range(cfg.eval_batches):
        tokens, prompt_len = sample_batch(examples, cfg.batch_size, rng)
        answer = torch.arange(tokens.shape[1])[None] >= prompt_len[:, None]
        masked = (torch.rand(tokens.shape, generator=gen) < torch.rand(tokens.shape[0], 1, generator=gen)) & answer
        noisy = torch.where(masked, spec.mask_token_id, tokens)
        dev = _device(model)
        logits = dllm_logits(model, noisy.to(dev), prompt_len, spec)
        ce = F.cross_entropy(logits.float().transpose(1, 2), tokens.to(dev), reduction="none")
        total += float((ce * masked.to(dev)).sum())
        count += int(masked.sum())
    model.train()
    return total / max(count, 1)


class CertaintyForcingCollate(StepSeeded):
    """Self-generated examples -> padded batch with dParallel's semi-autoregressive masks.

    Per row one response block is the *current* block: earlier blocks (and the prompt) stay clean,
    the current block is masked at ratio 0.5 in the first view and with the complementary mask in
    the second, later blocks are fully masked in both. Only the current block's masked tokens are
    supervised (as in dParallel's code): decoding never predicts a block with MASKs before it.
    With block attention nothing after the current block can reach it, so later blocks are cut off.
    """

    def __init__(self, spec: DllmSpec, cfg: DllmTrainConfig, seed: int):
        super().__init__(seed)
        self.spec, self.cfg = spec, cfg

    def __call__(self, rows: list[Example]) -> dict[str, Tensor]:
        cfg, eos = self.cfg, self.spec.eos_token_id
        _, gen = self.draw()
        width = max(len(ex.ids) for ex in rows)
        tokens = torch.tensor([ex.ids + [eos] * (width - len(ex.ids)) for ex in rows])
        valid = torch.tensor([[j < len(ex.ids) for j in range(width)] for ex in rows])
        prompt_len = torch.tensor([ex.prompt_len for ex in rows])
        b, n = tokens.shape
        rel = torch.arange(n)[None] - prompt_len[:, None]
        response = (rel >= 0) & valid
        blk = rel.div(cfg.block_size, rounding_mode="floor")
        n_blocks = (response.sum(1) + cfg.block_size - 1) // cfg.block_size
        current = (torch.rand(b, generator=gen) * n_blocks).long()[:, None]
        in_current = response & (blk == current)
        later = response & (blk > current)
        half = torch.rand(b, n, generator=gen) < 0.5
        if self.spec.attention == "block":
            valid &= ~later
            keep = int(valid.nonzero()[:, 1].max()) + 1
            tokens, valid, in_current, later, half = (t[:, :keep] for t in (tokens, valid, in_current, later, half))
        supervised = torch.cat([in_current & half, in_current & ~half])
        later = later.repeat(2, 1)
        targets = tokens.repeat(2, 1)
        return {
            "noisy": torch.where(supervised | later, self.spec.mask_token_id, targets),
            "targets": targets,
            "supervised": supervised,
            "valid": valid.repeat(2, 1),
            "prompt_len": prompt_len.repeat(2),
        }


def certainty_terms(logits: Tensor, targets: Tensor, supervised: Tensor, temperature: float, views: int = 2) -> tuple[Tensor, Tensor]:
    """Per view (rows are view-major): mean CE over the supervised tokens, and mean entropy of
    softmax(logits / temperature) over the supervised tokens whose argmax is already the target."""
    ce = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    correct = supervised & (logits.argmax(-1) == targets)
    logp = torch.log_softmax(logits / temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    per_view = lambda x, m: (x * m).view(views, -1).sum(1) / m.view(views, -1).sum(1).clamp(min=1)  # noqa: E731
    return per_view(ce, supervised), per_view(entropy, correct)


def certainty_forcing_loss(model, batch: dict[str, Tensor], spec: DllmSpec, cfg: DllmTrainConfig) -> Tensor:
    # dParallel certainty forcing: CE + CE_rev + w * (H + H_rev). The entropy term sharpens only what is
    # already right, so threshold rules commit it early without pushing wrong guesses to certainty.
    logits = dllm_logits(model, batch["noisy"], batch["prompt_len"], spec, batch["valid"]).float()
    ce, entropy = certainty_terms(logits, batch["targets"], batch["supervised"], cfg.cf_temperature)
    return ce.sum() + cfg.cf_entropy_weight * entropy.sum()


# --------------------------------------------------------------------------------------------
# Training, on specdec's one loop
# --------------------------------------------------------------------------------------------


def loop_config(cfg: DllmTrainConfig):
    """The dLLM hyper-parameters as a ``TrainConfig``: checkpoints as ``cfg.checkpoint_every`` says (None:
    none on disk), the cosine follows the clock under a budget (the step cap is then only a safety net)."""
    from specdec.train.loop import TrainConfig

    return TrainConfig(
        lr=cfg.lr, steps=cfg.max_steps, batch=cfg.batch_size, seq_len=cfg.seq_len, warmup=cfg.warmup_steps,
        weight_decay=cfg.weight_decay, betas=(0.9, 0.999), clip=1.0, seed=cfg.seed, checkpoint_every=cfg.checkpoint_every or 0,
        save_final_checkpoint=cfg.checkpoint_every is not None, budget_minutes=cfg.budget_minutes or 0.0, clock_schedule=True,
        mixed_precision=cfg.mixed_precision, progress=cfg.progress,
    )  # fmt: skip


def fit(model, examples: list[Example], collate, loss_fn, cfg: DllmTrainConfig, label: str, out_dir: str | Path | None = None,
        resume: bool = False, accelerator=None) -> tuple[object, dict]:
    """Run the loop over ``examples`` (repeated up to one batch when there are fewer); returns (model, curve).
    With ``cfg.checkpoint_every`` set, checkpoints go under ``out_dir/checkpoints`` and ``resume`` goes on
    from the newest complete one."""
    from specdec.train.loop import run_training

    rows = examples * math.ceil(cfg.batch_size / max(len(examples), 1))
    if cfg.checkpoint_every is None or out_dir is None:
        with tempfile.TemporaryDirectory() as scratch:  # nothing is written there (no checkpoints)
            res = run_training(loop_config(cfg), model, loss_fn, rows, scratch, collate_fn=collate, label=label, accelerator=accelerator)
    else:
        res = run_training(loop_config(cfg), model, loss_fn, rows, out_dir, resume=resume, collate_fn=collate, label=label,
                           accelerator=accelerator)
    return res.model, curve_summary(res.losses, res.wall_s)


def curve_summary(losses: list[float], seconds: float, points: int = 50) -> dict:
    window = max(1, min(20, len(losses) // 5))
    stride = max(1, len(losses) // points)
    return {
        "steps": len(losses),
        "seconds": round(seconds, 2),
        "loss_first": sum(losses[:window]) / window if losses else None,
        "loss_last": sum(losses[-window:]) / window if losses else None,
        "loss_min": min(losses) if losses else None,
        "loss_curve": [[i, round(v, 5)] for i, v in enumerate(losses) if i % stride == 0],
    }


# --------------------------------------------------------------------------------------------
# Building dLLMs
# --------------------------------------------------------------------------------------------


def convert_to_dllm(from_dir: str | Path | None, cfg: DllmTrainConfig, model_config: dict | None = None, tokenizer_dir: str | Path | None = None,
                    placement=None):
    """(model, tokenizer, spec): an AR checkpoint (or a fresh model from a config) with a MASK token added,
    in float32 (its every weight trains), loaded as ``placement`` says (remote code, attention).

    A dLLM passed as from_dir is taken as is (continued training, certainty forcing).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    trust = bool(placement and placement.trust_remote_code)
    attention = {"attn_implementation": placement.attn_implementation} if placement and placement.attn_implementation else {}
    if from_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(from_dir, trust_remote_code=trust)
        model = AutoModelForCausalLM.from_pretrained(from_dir, use_safetensors=True, dtype=torch.float32, trust_remote_code=trust, **attention)
        if read_config(from_dir).get("specdec_kind") == "dllm":
            return model, tokenizer, spec_of(model)
    else:
        if model_config is None or tokenizer_dir is None:
            raise SpecdecError("training a dLLM from scratch needs a model config and a tokenizer directory")
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust)
        model = AutoModelForCausalLM.from_config(LlamaConfig(**model_config), **attention)
    if tokenizer.eos_token_id is None:
        tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
    if tokenizer.mask_token_id is None:
        tokenizer.add_special_tokens({"mask_token": cfg.mask_token})
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))  # new rows start at the mean embedding
    model.config.update(
        {
            "specdec_kind": "dllm",
            "mask_token_id": tokenizer.mask_token_id,
            "dllm_attention": cfg.attention,
            "dllm_block_size": cfg.block_size,
            "token_shift": True,
            "eos_token_id": tokenizer.eos_token_id,
        }
    )
    model.config.use_cache = False
    return model, tokenizer, spec_of(model)


def spec_of(model) -> DllmSpec:
    c = model.config
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    return DllmSpec(c.mask_token_id, eos, c.dllm_attention, c.dllm_block_size, bool(c.token_shift))


def wrap_lora(model, cfg: DllmTrainConfig):
    from peft import LoraConfig, get_peft_model

    # dParallel uses r = alpha = 128; a rank above the hidden size only wastes memory on tiny models.
    rank = min(cfg.lora_rank, model.config.hidden_size)
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=cfg.lora_alpha * rank // cfg.lora_rank, target_modules=LORA_TARGETS, lora_dropout=0.0))


def self_generated_examples(model, tokenizer, spec: DllmSpec, prompts: list[str], cfg: DllmTrainConfig, deadline: float | None = None) -> list[Example]:
    """dParallel trains on the model's own responses: static one-token-per-step greedy decodes at
    ``cf_gen_length`` and ``block_size``, in batches of similar prompt lengths (less left padding),
    the batches in random order (a deadline must not favour short prompts).

    A response that stopped keeps its EOS-filled block, as decoding leaves it (later blocks are never
    decoded). With a ``deadline`` (time.monotonic()) no new batch starts after it; one batch always runs.
    """
    generator = DiffusionGenerator(model, tokenizer, spec, "static", gen_length=cfg.cf_gen_length, block_size=cfg.block_size, cache=cfg.cf_cache)
    limit = max(1, getattr(model.config, "max_position_embeddings", 1 << 30) - cfg.cf_gen_length)
    encoded = sorted((encode_prompt(tokenizer, p)[-limit:] for p in prompts), key=len)
    batches = [encoded[i : i + cfg.cf_decode_batch] for i in range(0, len(encoded), cfg.cf_decode_batch)]
    random.Random(cfg.seed).shuffle(batches)
    was_training = model.training
    model.eval()
    out = []
    for batch in batches:
        if out and deadline is not None and time.monotonic() > deadline:
            break
        for ids, r in zip(batch, generator.generate([GenRequest(ids, cfg.cf_gen_length) for ids in batch])):
            answer = r.token_ids
            if r.finish_reason == "stop":
                end = min(cfg.cf_gen_length, math.ceil((len(answer) + 1) / cfg.block_size) * cfg.block_size)
                answer = answer + [spec.eos_token_id] * (end - len(answer))
            out.append(Example(ids + answer, len(ids)))
    model.train(was_training)
    return out


def distillation_prompts(tokenizer, texts: list[str], pairs: list[tuple[str, str]], cfg: DllmTrainConfig) -> list[str]:
    """Code prompts cut from the training texts, then prompts of prompt/completion pairs (shuffled)."""
    pair_prompts = [p for p, _ in pairs]
    random.Random(cfg.seed).shuffle(pair_prompts)
    lo, hi = cfg.cf_prompt_tokens
    return code_prompts(tokenizer, texts, cfg.cf_prompts, cfg.seed, lo, hi) + pair_prompts[: cfg.cf_pair_prompts]


def train_dllm(
    from_dir: str | Path | None,
    texts_or_files: Iterable[str | Path],
    out_dir: str | Path,
    block_size: int = 32,
    attention: str = "block",
    max_steps: int = 500,
    budget_minutes: float | None = None,
    seed: int = 0,
    certainty_forcing: bool = False,
    lora: bool = False,
    extra_examples: Iterable[tuple[str, str]] | None = None,
    *,
    model_config: dict | None = None,
    tokenizer_dir: str | Path | None = None,
    placement=None,
    resume: bool = False,
    **overrides,
) -> dict:
    """Train a dLLM into ``out_dir`` and return its metrics (also written to metrics.json).

    ``texts_or_files``: literal texts or paths (JSONL with prompt[+completion], or plain text);
    ``extra_examples``: extra (prompt, completion) pairs such as list tasks. ``overrides`` set other
    ``DllmTrainConfig`` fields. With ``certainty_forcing`` the source must be a dLLM: it answers code
    prompts cut from the texts (and some pair prompts) with static one-token-per-step greedy decoding,
    then is distilled on those answers (``lora`` trains a LoRA and merges it). Under a budget the
    self-generation counts against it. The saved config lists the objectives the model went through
    (``dllm_training``).

    ``placement`` (models.loading.Placement): remote code, attention, threads and, ``cpu``, the device; the
    model trains whole in float32 on each process's device (``--mixed-precision`` autocasts), so a
    ``dtype`` or ``device_map`` is refused. ``checkpoint_every`` (an override) writes checkpoints under
    ``out_dir/checkpoints``; ``resume`` goes on from the newest complete one (the self-generated answers
    of certainty forcing are generated again: the same greedy decodes of the same model).
    """
    known = {f.name for f in fields(DllmTrainConfig)}
    if set(overrides) - known:
        raise SpecdecError(f"unknown training option(s): {', '.join(sorted(set(overrides) - known))}")
    cfg = DllmTrainConfig(
        block_size=block_size, attention=attention, max_steps=max_steps, budget_minutes=budget_minutes, seed=seed,
        certainty_forcing=certainty_forcing, lora=lora, **overrides,
    )  # fmt: skip
    placement = _trained_placement(placement)
    accelerator = _accelerator(cfg, placement)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    model, tokenizer, spec = convert_to_dllm(from_dir, cfg, model_config, tokenizer_dir, placement)
    model.to(accelerator.device)  # the held-out CE and the self-generated decodes run where training will
    apply_threads(placement.threads, model, rows=cfg.batch_size)
    if certainty_forcing and from_dir is not None and read_config(from_dir).get("specdec_kind") != "dllm":
        raise SpecdecError("--certainty-forcing distils an existing dLLM: pass one as --from (train it with train-dllm first)")
    texts, pairs = read_training_data(texts_or_files)
    pairs += list(extra_examples or [])
    examples = text_examples(tokenizer, texts, cfg.seq_len, spec.eos_token_id) + pair_examples(tokenizer, pairs, cfg.seq_len, spec.eos_token_id)
    if not examples:
        raise SpecdecError(f"no training examples: every text is shorter than --seq-len {cfg.seq_len} tokens and there are no prompt/completion pairs")
    rng.shuffle(examples)
    n_heldout = min(len(examples) // 2, max(1, int(len(examples) * cfg.heldout_fraction))) if len(examples) > 1 else 0
    heldout, train = examples[:n_heldout], examples[n_heldout:]
    ce_before = heldout_masked_ce(model, heldout, spec, cfg)

    distilled: dict = {}
    if certainty_forcing:
        started = time.monotonic()
        prompts = distillation_prompts(tokenizer, texts, pairs, cfg)
        if not prompts:
            raise SpecdecError("certainty forcing needs prompts: no code prompts could be cut from the data and there are no prompt/completion pairs")
        deadline = None if cfg.budget_minutes is None else started + 60 * cfg.budget_minutes * cfg.cf_generation_share
        own = self_generated_examples(model, tokenizer, spec, prompts, cfg, deadline)
        generation_s = time.monotonic() - started
        distilled = {"self_generated": len(own), "prompts_offered": len(prompts), "generation_seconds": round(generation_s, 2)}
    if cfg.lora:
        model = wrap_lora(model, cfg)
    if certainty_forcing:
        cf_loss = lambda m, batch: certainty_forcing_loss(m, batch, spec, cfg)  # noqa: E731
        fit_cfg = cfg if cfg.budget_minutes is None else replace(cfg, budget_minutes=max(0.05, cfg.budget_minutes - generation_s / 60))
        model, curve = fit(model, own, CertaintyForcingCollate(spec, cfg, cfg.seed), cf_loss, fit_cfg, "certainty forcing",
                           out_dir, resume, accelerator)
    else:
        ce_loss = lambda m, batch: masked_diffusion_loss(m, batch, spec)  # noqa: E731
        model, curve = fit(model, train, MaskedDiffusionCollate(spec, cfg, cfg.seed), ce_loss, cfg, "train-dllm", out_dir, resume, accelerator)
    if cfg.lora:
        model = model.merge_and_unload()
    metrics = {
        "objective": "certainty_forcing" if certainty_forcing else "masked_ce",
        "train_examples": len(train),
        "heldout_examples": len(heldout),
        "heldout_masked_ce_before": ce_before,
        "heldout_masked_ce": heldout_masked_ce(model, heldout, spec, cfg),
        **distilled,
        **curve,
    }
    model.config.update({"dllm_training": [*getattr(model.config, "dllm_training", []), metrics["objective"]]})
    save_dllm(model, tokenizer, out_dir, cfg, metrics, source=from_dir)
    return metrics


def save_dllm(model, tokenizer, out_dir: str | Path, cfg: DllmTrainConfig, metrics: dict, source) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_json(out / "metrics.json", metrics)
    write_json(out / "train_config.json", {**asdict(cfg), "source": str(source) if source else None, "tokenizer": tokenizer_fingerprint(tokenizer)})


def _device(model):
    return next(model.parameters()).device


def _trained_placement(placement):
    """The placement of a model that trains: where it runs and how it loads, never its dtype or a device map."""
    from specdec.models.loading import Placement

    placement = placement or Placement()
    if placement.dtype != "auto" or placement.device_map:
        raise UsageError("train-dllm trains every weight of its model in float32 on each process's device: --dtype and "
                         "--device-map place frozen models (use --mixed-precision for bf16 autocast)")
    return placement


def _accelerator(cfg: DllmTrainConfig, placement):
    """The accelerator the model trains with: on this process's GPU where there is one, on the CPU with ``--device cpu``."""
    from specdec.train.loop import make_accelerator

    return make_accelerator(loop_config(cfg), cpu=placement.device == "cpu")
