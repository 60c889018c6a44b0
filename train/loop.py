"""The one training loop every specdec trainer shares (draft, acceptance head, medusa/clover/eagle,
the recipe's target LM, dLLMs and certainty forcing, the Learn2PD filter).

A trainer hands over a module whose trainable parameters are optimised, a ``loss_fn(model, batch)``
that calls the module once and returns a scalar (or ``(scalar, {name: float})``), and a map-style
dataset of dicts of tensors. The loop touches accelerate through Accelerator(), prepare(),
accumulate(), backward(), save_state()/load_state() only.

Exact resume: the data order is a pure function of (seed, epoch, micro-step), so a resumed run
skips the micro-batches it already consumed and sees the same batches; model, optimizer, scheduler
and RNG states come back from ``accelerator.load_state``; the loss curve so far and the training
seconds spent (the budget's clock) are stored beside each checkpoint.

Checkpoints are atomic: written to ``step-N.tmp/``, fsynced, sealed with a ``COMPLETE`` manifest
(size and sha256 of every file) and renamed to ``step-N/``. Resume takes the newest checkpoint whose
files match its manifest and says on stderr which newer ones it skipped, so a process killed at any
point (or a checkpoint damaged later) costs at most the steps since the previous checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from specdec.decode.jobs.progress import ProgressBar
from specdec.models.artifacts import SpecdecError, UsageError, write_json


@dataclass
class TrainConfig:
    lr: float = 1e-3
    steps: int = 200  # optimizer steps
    batch: int = 8  # sequences per process per micro-batch
    seq_len: int = 128
    grad_accum: int = 1
    warmup: int = 10
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = 50  # 0 = only at the end
    keep_checkpoints: int = 2  # at least 2 are kept: a damaged newest one falls back to the one before
    save_final_checkpoint: bool = True  # False with checkpoint_every 0: nothing is written (no resume)
    budget_minutes: float = 0.0  # 0 = no wall-clock budget
    # under a budget, the cosine follows the clock: progress = max(step / steps, elapsed / budget), so a
    # run whose step cap is only a safety net still decays its learning rate by the time the budget ends
    # (the clock counts training seconds and carries over a resume, so does the budget)
    clock_schedule: bool = False
    mixed_precision: str = "auto"  # "auto" | "no" | "bf16" | "fp16" (auto: see resolve_precision)
    heldout: float = 0.1  # fraction of blocks held out for metrics
    log_every: int = 10
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # trainer-specific knobs from the recipe

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d


def load_config(path: str | Path | None = None, overrides: dict | None = None, section: str | None = None) -> TrainConfig:
    """YAML recipe (optionally one section of it) then CLI overrides (None values are ignored).

    Unknown keys are an error; a recipe's trainer-specific keys go under ``extra:``.
    """
    data: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise UsageError(f"cannot read recipe {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise UsageError(f"recipe {path} must be a mapping")
        data = dict(raw.get(section, raw)) if section and section in raw else dict(raw)
        data.pop("command", None)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return config_from_dict(data, where=str(path) if path else "overrides")


def config_from_dict(data: dict, where: str = "config") -> TrainConfig:
    known = {f.name: f for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise UsageError(f"unknown training config key(s) in {where}: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    cfg = TrainConfig()
    for key, value in data.items():
        default = getattr(cfg, key)
        try:
            if key == "betas":
                value = tuple(float(v) for v in value)
            elif key == "extra":
                value = {**cfg.extra, **dict(value)}
            elif isinstance(default, bool):
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
            elif isinstance(default, (int, float, str)):
                value = type(default)(value)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"bad value for {key} in {where}: {value!r}") from exc
        setattr(cfg, key, value)
    if cfg.mixed_precision not in ("auto", "no", "bf16", "fp16"):
        raise UsageError(f"mixed_precision must be auto, no, bf16 or fp16, not {cfg.mixed_precision!r}")
    if cfg.steps < 1 or cfg.batch < 1 or cfg.grad_accum < 1:
        raise UsageError("steps, batch and grad_accum must be >= 1")
    return cfg


def resolve_precision(mode: str) -> str:
    """``auto``: bf16 autocast where the hardware computes bf16 natively (a CUDA GPU that supports it,
    a CPU with AVX512-BF16 or AMX), else fp32 (``no``). On a CPU without them bf16 is emulated: a
    training step of the default target took 2x as long as in fp32 on such a machine (AVX512 only),
    while on one with AMX bf16 ran 3.6x faster than fp32."""
    if mode != "auto":
        return mode
    import torch

    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "bf16" if native else "no"


def save_config(cfg: TrainConfig, out_dir: Path, extra: dict | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "training_config.yaml").write_text(yaml.safe_dump({**cfg.to_dict(), **(extra or {})}, sort_keys=True))


# ---------------------------------------------------------------------------------------------
# Data order


class EpochBatches:
    """Batches of one epoch for one process: a seeded permutation, sharded round-robin, with the
    first ``skip`` micro-batches of this process dropped (resume)."""

    def __init__(self, n: int, batch: int, rank: int, world: int, seed: int, epoch: int, skip: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        per_step = batch * world
        self.batches = [
            perm[i * per_step + rank * batch : i * per_step + (rank + 1) * batch] for i in range(n // per_step)
        ][skip:]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def micro_batches_per_epoch(n: int, batch: int, world: int) -> int:
    return n // (batch * world)


# ---------------------------------------------------------------------------------------------
# The loop


@dataclass
class TrainResult:
    steps: int
    losses: list[float]
    stopped: str  # "steps" | "budget"
    wall_s: float  # this process's training seconds
    model: Any  # the unwrapped module
    accelerator: Any
    logs: list[dict] = field(default_factory=list)
    elapsed_s: float = 0.0  # training seconds over the whole run, resumed parts included (the budget's clock)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process


def make_accelerator(cfg: TrainConfig, cpu: bool = False):
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    # accelerate keeps one process-wide state; several trainings in one process (the family recipe,
    # tests) may differ in precision and accumulation, so each run starts from a fresh one. The
    # process group (PartialState) is kept.
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    # cpu=True lets torchrun-style launches (accelerate launch --multi_gpu) form a gloo group on a
    # machine without CUDA; with CUDA the accelerator picks the GPU as usual.
    return Accelerator(
        mixed_precision=resolve_precision(cfg.mixed_precision),
        gradient_accumulation_steps=cfg.grad_accum,
        cpu=cpu or not torch.cuda.is_available(),  # cpu: a trainer asked for the CPU (--device cpu)
    )


def run_training(
    cfg: TrainConfig,
    model_to_train,
    loss_fn: Callable,
    dataset,
    out_dir: str | Path,
    resume: bool = False,
    accelerator=None,
    collate_fn: Callable | None = None,
    label: str = "train",
) -> TrainResult:
    """Optimise ``model_to_train`` for ``cfg.steps`` optimizer steps (or until the budget).

    Checkpoints go to ``out_dir/checkpoints/step-N``; with ``resume`` the newest complete one is
    restored, its training seconds included (the budget and a clock schedule go on from there).
    ``collate_fn`` turns a list of dataset items into the batch ``loss_fn`` takes (default: stacking); one
    that draws random numbers does so as a ``StepSeeded``, so a resumed run draws what an uninterrupted one would.
    ``label`` names the progress bar.
    Returns the unwrapped model (main and other processes alike) and the loss curve.
    """
    import torch
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    out_dir = Path(out_dir)
    accelerator = accelerator or make_accelerator(cfg)
    set_seed(cfg.seed)
    n = len(dataset)
    world, rank = accelerator.num_processes, accelerator.process_index
    per_epoch = micro_batches_per_epoch(n, cfg.batch, world)
    if per_epoch == 0:
        raise SpecdecError(
            f"not enough training data: {n} blocks for batch {cfg.batch} x {world} process(es); "
            "lower --batch/seq_len or add data"
        )
    params = [p for p in model_to_train.parameters() if p.requires_grad]
    if not params:
        raise SpecdecError("the model has no trainable parameters")
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    # budget spent so far, as agreed by every process (the stop decision and a clock schedule must not
    # differ between ranks, or the next collective hangs / the replicas drift apart)
    clock = {"elapsed": 0.0}
    keep = max(cfg.keep_checkpoints, 2)
    budget_s = cfg.budget_minutes * 60
    by_clock = (lambda: clock["elapsed"] / budget_s) if cfg.clock_schedule and budget_s > 0 else None
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(cfg.warmup, cfg.steps, by_clock))
    model, optimizer = accelerator.prepare(model_to_train, optimizer)
    # the scheduler steps once per optimizer step whatever the process count (not prepared on purpose)
    accelerator.register_for_checkpointing(scheduler)

    ckpt_root = out_dir / "checkpoints"
    step, losses, logs, elapsed0, resumed_at = 0, [], [], 0.0, None
    if resume:
        latest = _agreed_latest(accelerator, ckpt_root)
        if latest is None:
            accelerator.print(f"no complete checkpoint under {ckpt_root}: starting from scratch", file=sys.stderr)
        else:
            accelerator.load_state(str(latest))
            state = json.loads((latest / "trainer_state.json").read_text())
            step, losses, logs = state["step"], state["losses"], state.get("logs", [])
            elapsed0 = float(state.get("elapsed_s", 0.0))
            resumed_at = step
    clock["elapsed"] = elapsed0

    def elapsed() -> float:  # training seconds so far; synced across processes only under a budget
        return elapsed0 + _synced_elapsed(accelerator, start) if budget_s > 0 else elapsed0 + time.perf_counter() - start

    consumed = step * cfg.grad_accum  # micro-batches per process
    epoch, skip = divmod(consumed, per_epoch)
    if isinstance(collate_fn, StepSeeded):
        collate_fn.start(consumed)
    start = time.perf_counter()
    stopped = "steps"
    progress = _Progress(cfg.steps, step, enabled=cfg.progress and accelerator.is_main_process, budget_s=budget_s, label=label,
                         elapsed=elapsed0)
    if budget_s > 0 and elapsed0 > budget_s:
        stopped = "budget"  # resumed after the budget ran out: nothing is left to train
    window: list[float] = []
    model.train()
    with progress:
        while step < cfg.steps and stopped != "budget":
            order = EpochBatches(n, cfg.batch, rank, world, cfg.seed, epoch, skip)
            loader = DataLoader(dataset, batch_sampler=order, collate_fn=collate_fn, num_workers=0)
            skip = 0
            for batch in loader:
                batch = _to_device(batch, accelerator.device)
                with accelerator.accumulate(model):
                    out = loss_fn(model, batch)
                    loss, extra = (out if isinstance(out, tuple) else (out, {}))
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and cfg.clip > 0:
                        accelerator.clip_grad_norm_(params, cfg.clip)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                window.append(float(loss.detach()))
                if not accelerator.sync_gradients:
                    continue
                scheduler.step()
                step += 1
                mean = torch.tensor(sum(window) / len(window), device=accelerator.device)
                step_loss = float(accelerator.reduce(mean, reduction="mean"))
                window = []
                losses.append(step_loss)
                if step % max(cfg.log_every, 1) == 0 or step == cfg.steps:
                    logs.append({"step": step, "loss": step_loss, "lr": scheduler.get_last_lr()[0], **{k: float(v) for k, v in extra.items()}})
                if budget_s > 0:
                    clock["elapsed"] = elapsed()
                progress.step(step, step_loss, clock["elapsed"])
                at_cap = step >= cfg.steps
                over = budget_s > 0 and clock["elapsed"] > budget_s
                # the last step's checkpoint is the final one, written once below
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and not (at_cap or over):
                    _checkpoint(accelerator, ckpt_root, step, losses, logs, keep, clock["elapsed"] if budget_s > 0 else elapsed())
                if at_cap:
                    break
                if over:
                    stopped = "budget"
                    break
            if stopped == "budget":
                break
            epoch += 1
    total = clock["elapsed"] if budget_s > 0 else elapsed()
    if cfg.save_final_checkpoint and step != resumed_at:  # resumed at the end: that checkpoint is this state
        _checkpoint(accelerator, ckpt_root, step, losses, logs, keep, total)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.eval()
    return TrainResult(step, losses, stopped, time.perf_counter() - start, unwrapped, accelerator, logs, total)


# ---------------------------------------------------------------------------------------------
# Checkpoints

MARKER = "COMPLETE"
_STEP_DIR = re.compile(r"step-(\d+)")


def latest_checkpoint(root: Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint under ``root`` whose files are intact, or None.

    Newer ones that are incomplete or corrupt are skipped with a warning (``warn``, default stderr).
    """
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    if not root.is_dir():
        return None
    skipped: list[tuple[Path, str]] = []
    chosen = None
    for path in sorted(_step_dirs(root), key=_step_of, reverse=True):
        reason = checkpoint_problem(path)
        if reason is None:
            chosen = path
            break
        skipped.append((path, reason))
    then = f"resuming from {chosen}" if chosen else "no complete checkpoint left: starting from scratch"
    for path, reason in skipped:
        warn(f"warning: checkpoint {path} is incomplete or corrupt ({reason}); {then}")
    return chosen


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed from, or None when it is intact.

    A checkpoint with a ``COMPLETE`` manifest must match it file by file (size, sha256). One from
    before manifests were written is accepted when its trainer state parses and its safetensors
    files hold every byte their headers promise."""
    marker = path / MARKER
    try:
        if marker.exists():
            manifest = json.loads(marker.read_text())
            for name, want in sorted(manifest["files"].items()):
                f = path / name
                if not f.is_file():
                    return f"{name} is missing"
                if f.stat().st_size != want["size"]:
                    return f"{name} has {f.stat().st_size} bytes, {want['size']} were written"
                if _sha256(f) != want["sha256"]:
                    return f"{name} does not match its checksum"
        else:
            if not (path / "trainer_state.json").exists():
                return "no COMPLETE marker"
            for f in sorted(path.glob("*.safetensors")):
                problem = _safetensors_problem(f)
                if problem:
                    return f"{f.name}: {problem}"
        state = json.loads((path / "trainer_state.json").read_text())
        if state["step"] != _step_of(path):
            return f"trainer_state.json is for step {state['step']}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _agreed_latest(accelerator, root: Path) -> Path | None:
    """The main process picks the checkpoint and every process resumes from that same one."""
    chosen = latest_checkpoint(root) if accelerator.is_main_process else None
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [str(chosen) if chosen else None]
        broadcast_object_list(box, from_process=0)
        chosen = Path(box[0]) if box[0] else None
    return chosen


def _checkpoint(accelerator, root: Path, step: int, losses: list, logs: list, keep: int, elapsed_s: float) -> None:
    final, tmp = root / f"step-{step}", root / f"step-{step}.tmp"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.iterdir():  # the remains of a write or removal cut short
            if leftover.is_dir() and leftover.suffix in (".tmp", ".old", ".del"):
                _rmtree(leftover)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()  # every process's RNG state is in tmp
    if accelerator.is_main_process:
        write_json(tmp / "trainer_state.json", {"step": step, "losses": losses, "logs": logs, "elapsed_s": elapsed_s})
        files = {}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            _fsync(f)
            files[f.relative_to(tmp).as_posix()] = {"size": f.stat().st_size, "sha256": _sha256(f)}
        for d in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
            _fsync(d)
        with open(tmp / MARKER, "w") as fh:
            json.dump({"step": step, "files": files}, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync(tmp)
        if final.exists():  # a damaged checkpoint of this step, skipped by the resume that led here
            os.replace(final, final.with_name(final.name + ".old"))
        os.replace(tmp, final)
        _fsync(root)
        _rmtree(final.with_name(final.name + ".old"))
        # keep the newest ``keep`` at or below this step; higher ones belong to a run this one replaced
        # (they were skipped as damaged, or a fresh run started over in this directory)
        older = sorted((p for p in _step_dirs(root) if _step_of(p) < step), key=_step_of)
        newer = [p for p in _step_dirs(root) if _step_of(p) > step]
        for old in older[: max(0, len(older) - (keep - 1))] + newer:
            gone = old.with_name(old.name + ".del")  # renamed first: a half-removed dir never looks like a checkpoint
            os.replace(old, gone)
            _rmtree(gone)
        _fsync(root)
    accelerator.wait_for_everyone()


def _step_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)]


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safetensors_problem(path: Path) -> str | None:
    """None when the file's header parses and the file is as long as the header says."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "truncated header"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return "truncated header"
        header = json.loads(fh.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        return f"{size} bytes, the header needs {8 + n + end}"
    return None


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _synced_elapsed(accelerator, start: float) -> float:
    import torch

    # the slowest process's clock: every process must take the same stop decision and learning rate
    elapsed = torch.tensor([time.perf_counter() - start], device=accelerator.device)
    return float(accelerator.gather(elapsed).max())


def _warmup_cosine(warmup: int, total: int, clock: Callable[[], float] | None = None) -> Callable[[int], float]:
    """Linear warmup, then cosine from 1 to 0.1 over the steps (or over the budget's clock when given)."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        if clock is not None:
            progress = max(progress, clock())
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return f


def _to_device(batch, device):
    if hasattr(batch, "to"):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


class StepSeeded:
    """A collate function whose random draws are a function of the seed and of the micro-batch's index
    (``draw``), not of the batches drawn before: ``run_training`` tells it which micro-batch comes first
    (``start``), so a run resumed from a checkpoint draws what the uninterrupted run would have."""

    def __init__(self, seed: int):
        self.seed, self.index = seed, 0

    def start(self, index: int) -> None:
        self.index = index

    def draw(self):
        """(random.Random, torch.Generator) for the next micro-batch."""
        import random

        import torch

        index, self.index = self.index, self.index + 1
        return random.Random(f"{self.seed}/{index}"), torch.Generator().manual_seed((self.seed * 1_000_003 + index) % (1 << 62))


class _Progress(ProgressBar):
    """The training bar (main process only): steps done of the total, or under a budget, where the step
    cap is often only a safety net, the share of the run done (steps or clock, whichever is further)
    with the step count as text."""

    def __init__(self, total: int, done: int, enabled: bool, budget_s: float = 0.0, label: str = "train", elapsed: float = 0.0):
        self.total, self.budget_s = total, budget_s
        super().__init__(label, 1.0 if budget_s else total, enabled=enabled, completed=self._done(done, elapsed),
                         count="step {task.fields[step]}" if budget_s else None, status="loss -", step=done)

    def _done(self, step: int, elapsed: float) -> float:
        return min(1.0, max(step / self.total, elapsed / self.budget_s)) if self.budget_s else step

    def step(self, step: int, loss: float, elapsed: float = 0.0) -> None:
        self.update(completed=self._done(step, elapsed), status=f"loss {loss:.4f}", step=step)
