"""What a masked-diffusion LM (dLLM) is to specdec: its spec, its loader, its attention masks, the
prompt encoding every dLLM path shares, and the Learn2PD filter module."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from specdec.models.artifacts import load_weights, read_config, write_json
from specdec.models.errors import SpecdecError
from specdec.models.masks import additive_mask




@dataclass(frozen=True)
class DllmSpec:
    """How to drive a masked-diffusion checkpoint.

    ``attention`` is ``bidirectional`` or ``block`` for specdec's own dLLMs (a stock Llama given a
    custom 4-D mask) and ``native`` for remote-code models that build their own attention.
    ``token_shift``: the logit at position i-1 predicts token i (AR-adapted models, Dream).
    """

    mask_token_id: int
    eos_token_id: int | None
    attention: str = "block"
    block_size: int = 32
    token_shift: bool = True

    @property
    def shift(self) -> int:
        return int(self.token_shift)


def load_dllm(path: str | Path, trust_remote_code: bool = False, token_shift: bool | None = None, dtype: str | torch.dtype | None = None,
              attn_implementation: str | None = None, device_map: str | None = None):
    """Load ``(model, tokenizer, DllmSpec)``.

    specdec's own dLLMs are plain Llama checkpoints (safetensors only). Third-party diffusion
    checkpoints (LLaDA, Dream) run their own modeling code and therefore need an explicit
    ``trust_remote_code=True``; their config may say ``token_shift`` (LLaDA: no shift, the default;
    Dream: shift), which ``token_shift`` overrides. ``dtype``: as saved when None. ``attn_implementation``
    and ``device_map`` go to ``from_pretrained`` when given.
    """
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    cfg = read_config(path)
    own = cfg.get("specdec_kind") == "dllm"
    if not own and not trust_remote_code:
        raise SpecdecError(
            f"{path} is not a specdec dLLM (config.json lacks specdec_kind=dllm); third-party diffusion "
            "checkpoints such as LLaDA or Dream load only with --trust-remote-code"
        )
    kwargs = {} if dtype is None else {"dtype": getattr(torch, dtype) if isinstance(dtype, str) else dtype}
    kwargs |= {k: v for k, v in (("attn_implementation", attn_implementation), ("device_map", device_map)) if v}
    if own:
        model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, **kwargs)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs)
        except ValueError:  # Dream registers only AutoModel
            model = AutoModel.from_pretrained(path, trust_remote_code=True, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code and not own)
    mask_id = cfg.get("mask_token_id", tokenizer.mask_token_id)
    if mask_id is None:
        raise SpecdecError(f"{path}: config.json has no mask_token_id and the tokenizer has no mask token")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    spec = DllmSpec(
        mask_token_id=int(mask_id),
        eos_token_id=None if eos is None else int(eos),
        attention=cfg.get("dllm_attention", "bidirectional") if own else "native",
        block_size=int(cfg.get("dllm_block_size", 32)),
        token_shift=bool(cfg.get("token_shift", own)) if token_shift is None else token_shift,
    )
    model.eval()
    return model, tokenizer, spec


def dllm_attention(valid: Tensor, context_len: Tensor, attention: str, block_size: int) -> Tensor:
    """Boolean [B, 1, N, N] mask (True = attend) for a stock HF model.

    Positions before ``context_len[b]`` are the clean context and stay causal, as in the AR model
    we adapt from (so a prompt's keys never depend on the answer). From ``context_len`` on, the
    prediction slots are grouped into blocks: ``bidirectional`` is one block, ``block`` uses
    blocks of ``block_size`` that see each other causally and themselves fully. With the token
    shift ``context_len`` is prompt_len - 1, so a block of slots is exactly the block of tokens it
    predicts. Invalid keys (padding) are hidden; every query sees itself so no row is empty
    (an all-False row makes SDPA return NaN).
    """
    n = valid.shape[1]
    pos = torch.arange(n, device=valid.device)
    rel = pos[None, :] - context_len[:, None]
    if attention == "block":
        blk = torch.where(rel >= 0, rel.div(block_size, rounding_mode="floor"), -1)
    else:
        blk = torch.where(rel >= 0, 0, -1)
    causal = pos[:, None] >= pos[None, :]
    q_blk, k_blk = blk[:, :, None], blk[:, None, :]
    allowed = (causal[None] | ((q_blk >= 0) & (k_blk <= q_blk))) & valid[:, None, :]
    allowed |= torch.eye(n, dtype=torch.bool, device=valid.device)[None]
    return allowed[:, None]


def model_mask(model, allowed: Tensor) -> Tensor:
    """The 4-D mask in the form the model's attention implementation takes (transformers passes it through)."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl == "sdpa":
        return allowed
    if impl == "eager":
        return additive_mask(allowed, model.dtype)
    raise SpecdecError(f"diffusion decoding needs sdpa or eager attention (a custom 4-D mask), not {impl}")

def encode_prompt(tokenizer, text: str) -> list[int]:
    """How every dLLM prompt is tokenized (training, filter labels, bench): the tokenizer's defaults."""
    return tokenizer(text)["input_ids"]




class ConfidenceFilter(nn.Module):
    """Learn2PD: per-position 'already final?' logits from the block's top-1 confidences.

    hidden=0 is the logistic regression of the public code; hidden>0 a one-hidden-layer MLP.
    """

    def __init__(self, width: int = 32, hidden: int = 0):
        super().__init__()
        self.width, self.hidden = width, hidden
        self.net = nn.Linear(width, width) if hidden == 0 else nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

    def forward(self, conf: Tensor) -> Tensor:
        return self.net(conf)


def save_filter(filt: ConfidenceFilter, out_dir: str | Path, config: dict) -> None:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in filt.state_dict().items()}, str(out / "model.safetensors"))
    write_json(out / "config.json", {"kind": "filter", "width": filt.width, "hidden": filt.hidden, **config})


def load_filter(path: str | Path) -> ConfidenceFilter:
    cfg = read_config(path)
    if cfg.get("kind") != "filter":
        raise SpecdecError(f"{path} is not a Learn2PD filter (config.json kind={cfg.get('kind')!r})")
    filt = ConfidenceFilter(cfg["width"], cfg.get("hidden", 0))
    filt.load_state_dict(load_weights(path))
    return filt.eval()
