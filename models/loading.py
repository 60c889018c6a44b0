"""The one model-loading and placement layer: every command loads targets, drafts and dLLMs here.

A model is named by a local folder, a GGUF file (converted once to a folder, ``models.gguf``), a family
(``gemma3-270m``: its target) or a member of one (``target``, ``draft``, ``tiny-stdlib/draft``), or a
Hugging Face hub id (resolved by ``from_pretrained``, so ``HF_HUB_OFFLINE=1`` and a local hub cache
work as they do for transformers). Weights load from safetensors only; remote code runs only with
``trust_remote_code``. ``Placement`` holds the options every command shares under the same names:
``--device``, ``--dtype``, ``--device-map``, ``--attn-implementation``, ``--trust-remote-code`` and
``--threads``.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from specdec.models.artifacts import FAMILY_MEMBERS, family_spec, read_config, resolve_member
from specdec.models.env import quiet_progress
from specdec.models.errors import SpecdecError, UsageError

DEVICES_HELP = "auto (CUDA when present), cpu, cuda or cuda:N"
DTYPES = ("auto", "bfloat16", "float16", "float32")
# specdec's verify and tree forwards pass a 4-D mask (holes, trees, sliding windows); these
# implementations take one as given. flash-attention kernels take only padding masks.
MASK_ATTENTION = ("eager", "sdpa", "flex_attention", "specdec_tree")
# a forward's work is its parameters times the rows it carries: below this much, its operations are too
# short for intra-op threads to pay for their synchronisation (measured on a 2-core CPU, at 1 and 8 rows:
# docs/benchmarks.md, "CPU threads"). Rows count because a batch of 8 small rows is as long a forward as
# one row of a model 8 times larger.
THREADS_MIN_WORK = 1_200_000


@dataclass
class Placement:
    """Where and how models run; the fields are the shared command-line options."""

    device: str = "auto"
    dtype: str = "auto"
    device_map: str | None = None  # "auto": accelerate's big-model placement across the visible devices
    attn_implementation: str | None = None  # None: the model's own choice
    trust_remote_code: bool = False
    threads: int = 0  # 0: follow the load (models.threads) under a ceiling: all cores for forwards of THREADS_MIN_WORK (parameters x rows) and more, one below
    weights: str = "auto"  # "auto": a GGUF target's layers read the file's blocks in the engine (models.blocks); "float32": its float32 weights

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.device_map not in (None, "auto"):
            raise UsageError(f"--device-map must be auto (or left out), not {self.device_map!r}")
        if self.threads < 0:
            raise UsageError(f"--threads must be >= 0 (0: automatic), not {self.threads}")
        check_weights(self.weights)
        if self.attn_implementation is not None and self.attn_implementation not in MASK_ATTENTION:
            raise UsageError(
                f"--attn-implementation {self.attn_implementation!r} cannot take specdec's 4-D attention masks "
                f"(trees, holes left by rejected drafts); use one of {', '.join(MASK_ATTENTION[:3])}"
            )
        resolve_device(self.device)  # fail on a malformed device before anything loads


WEIGHTS = ("auto", "float32")


def check_weights(value) -> None:
    if value not in WEIGHTS:
        raise UsageError(f"--weights must be one of {', '.join(WEIGHTS)} (auto: a GGUF target's quantised blocks, with the "
                         f"same weights, where the kernel runs), not {value!r}")


def resolve_device(name: str):
    """``auto`` -> cuda when a GPU is visible, else cpu; ``cuda:N`` must exist."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device must be {DEVICES_HELP}, not {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be {DEVICES_HELP}, not {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA device is visible to this process")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def native_bf16(device) -> bool:
    """Whether ``device`` computes bf16 natively (emulated bf16 on a CPU is slower than fp32)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def resolve_dtype(name: str, device, config=None):
    """``auto``: the checkpoint's dtype on an accelerator (and on a CPU with native bf16), float32 on
    other CPUs; an explicit name is honoured everywhere."""
    import torch

    if name != "auto":
        return getattr(torch, name)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    if saved not in (torch.float16, torch.bfloat16, torch.float32):
        saved = torch.float32
    if device.type == "cpu" and not (saved == torch.bfloat16 and native_bf16(device)):
        return torch.float32
    return saved


def resolve_source(name: str | os.PathLike) -> str:
    """A local model folder, a GGUF file (or a folder holding one: converted once, see models.gguf), a
    family (its target) or family member, or a hub id for ``from_pretrained``."""
    from specdec.models.gguf import gguf_in_folder, gguf_target, is_gguf

    path = Path(name)
    if path.exists():
        if path.is_dir():
            inner = gguf_in_folder(path)
            return str(gguf_target(inner)) if inner is not None else str(path)
        if is_gguf(path):
            return str(gguf_target(path))
        raise UsageError(f"{name} is a file; a model is a folder (config.json, *.safetensors), a .gguf file or a hub id")
    if str(name) in FAMILY_MEMBERS or family_spec(str(name)) is not None:
        return str(resolve_member(str(name)))
    text = str(name)
    if is_gguf(text):
        raise UsageError(f"no such GGUF file: {name}")
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or not text:
        raise SpecdecError(f"no such model folder: {name}")
    return text  # a hub id: from_pretrained resolves it (offline against the local cache with HF_HUB_OFFLINE=1)


def _is_local(source: str) -> bool:
    return Path(source).is_dir()


def load_model_config(source: str, placement: Placement):
    """The model's transformers config, with a clear error for a missing or malformed one."""
    from transformers import AutoConfig

    if _is_local(source):
        cfg_path = Path(source) / "config.json"
        if not cfg_path.exists():
            raise SpecdecError(f"{source} has no config.json: not a Hugging Face model folder")
        try:
            json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpecdecError(f"{cfg_path} is not valid JSON: {exc}") from None
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=placement.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecdecError(_load_error(source, exc)) from None


def _load_error(source: str, exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "trust_remote_code" in str(exc):
        return f"{source} needs its own Python code to load: pass --trust-remote-code if you trust it"
    if not _is_local(source):
        return f"cannot load {source!r} (not a local folder; as a hub id: {text})"
    return f"cannot load {source}: {text}"


def _check_safetensors(source: str) -> None:
    if _is_local(source) and not any(Path(source).glob("*.safetensors")):
        raise SpecdecError(f"{source}: no .safetensors weights (specdec never loads pickled checkpoints)")


def load_causal_lm(source: str, placement: Placement, device=None, dtype=None):
    """A causal LM in eval mode, placed by ``placement`` (or on ``device`` / in ``dtype`` when given:
    a draft goes where its target's first layers are)."""
    from transformers import AutoModelForCausalLM

    config = load_model_config(source, placement)
    _check_safetensors(source)
    device = resolve_device(placement.device) if device is None else device
    dtype = resolve_dtype(placement.dtype, device, config) if dtype is None else dtype
    kwargs = {"dtype": dtype, "use_safetensors": True, "trust_remote_code": placement.trust_remote_code}
    if placement.attn_implementation:
        kwargs["attn_implementation"] = placement.attn_implementation
    if placement.device_map:
        kwargs["device_map"] = placement.device_map
    quiet_progress()
    try:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, **kwargs)  # the config read above, not read again
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise SpecdecError(_load_error(source, exc)) from None
    except Exception as exc:  # safetensors reports a truncated file with its own exception type
        if type(exc).__module__.startswith("safetensors"):
            raise SpecdecError(f"cannot load {source}: its safetensors weights are damaged ({exc})") from None
        raise
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in MASK_ATTENTION:
        raise UsageError(f"{source} loaded with attention {impl!r}, which cannot take specdec's 4-D masks; "
                         f"pass --attn-implementation sdpa (or eager)")
    if not placement.device_map:
        model.to(device)
    return model.eval().requires_grad_(False)


def load_tokenizer(source: str, placement: Placement):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=placement.trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise SpecdecError(_load_error(source, exc)) from None


def load_target(name: str | os.PathLike, placement: Placement | None = None, device=None, rows: int = 1):
    """(model, tokenizer, source) of a target; threads are set for its size and the ``rows`` its
    forwards carry (a decode's batch size). ``device`` overrides the placement's (a trainer's process device)."""
    placement = placement or Placement()
    source = resolve_source(name)
    model = load_causal_lm(source, placement, device=device)
    from specdec.models import blocks, gguf, head, norms

    head.install(model)  # a large float32 output layer on a CPU runs as models.head dispatches it inside the engine
    norms.install(model)  # Gemma's norms in fewer operations where they compute the same floats
    if placement.weights == "auto" and Path(source).is_dir() and gguf.ensure_blocks(Path(source)):
        blocks.install(model, source)  # a GGUF target's layers multiply by the file's blocks inside the engine
    apply_threads(placement.threads, model, rows)
    return model, load_tokenizer(source, placement), source


_loaded: dict | None = None  # within ``reuse_loaded``: frozen drafts and heads already loaded, by what was asked


@contextlib.contextmanager
def reuse_loaded():
    """Within: a draft (or head artifact) loaded again with the same placement is the one loaded before.
    A bench builds every method afresh for each pass; its frozen weights need not be read again
    (and a compiled step's graphs stay valid for the same tensors)."""
    global _loaded
    outer = _loaded
    _loaded = {} if outer is None else outer
    try:
        yield
    finally:
        _loaded = outer


def cached(key, load):
    """``load()``, or within ``reuse_loaded`` the result of an earlier call with the same ``key``."""
    if _loaded is None:
        return load()
    if key not in _loaded:
        _loaded[key] = load()
    return _loaded[key]


def load_draft(name: str | os.PathLike, placement: Placement | None = None, device=None, dtype=None):
    """A draft model: a plain causal LM, or a peft LoRA adapter over its base (merged on load)."""
    placement = placement or Placement()
    return cached(("draft", str(name), repr(placement), str(device), str(dtype)),
                  lambda: _load_draft(name, placement, device, dtype))


def _load_draft(name, placement: Placement, device, dtype):
    source = resolve_source(name)
    if _is_local(source) and (Path(source) / "adapter_config.json").exists():
        from peft import PeftModel

        cfg = read_config(source)
        base_dir = cfg.get("specdec_adapter_base") or json.loads((Path(source) / "adapter_config.json").read_text())["base_model_name_or_path"]
        base = load_causal_lm(resolve_source(base_dir), placement, device, dtype)
        model = PeftModel.from_pretrained(base, source).merge_and_unload()
        return model.eval().requires_grad_(False)
    return load_causal_lm(source, placement, device, dtype)


def input_device(model):
    """Where a model's inputs go: the device of its input embeddings (the first layers under a device map)."""
    return model.get_input_embeddings().weight.device


def apply_threads(threads: int, model=None, rows: int = 1) -> int:
    """Set torch's intra-op threads: ``threads`` when given (fixed), else a ceiling of all cores when
    ``model``'s forwards of ``rows`` rows are THREADS_MIN_WORK of work and more, one below, under which
    the count follows the load (``models.threads``: cores other processes keep busy are left to them).
    Returns the number set now."""
    from specdec.models import threads as governor

    if threads > 0:
        governor.fix(threads)
        return threads
    size = sum(p.numel() for p in model.parameters()) if model is not None else 0
    ceiling = (os.cpu_count() or 1) if size * max(rows, 1) >= THREADS_MIN_WORK else 1
    return governor.follow_load(ceiling).current
