"""What every bench report carries besides its numbers, and the one plot of a report.

A report is only comparable with the run that made it: ``provenance`` records the command line, the
machine, the date and specdec's version, which docs/benchmarks.md shows beside each table.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path


def cli_command(argv: list[str] | None = None) -> str:
    """``specdec`` and the arguments after the program name (``sys.argv`` by default), shell-quoted,
    the specdec home shown as ``$SPECDEC_HOME``."""
    return shown_home("specdec " + shlex.join(sys.argv[1:] if argv is None else argv))


def shown_home(text: str) -> str:
    """``text`` with the specdec home folder written ``$SPECDEC_HOME``: a report's command reruns on any
    machine, whose home lies elsewhere (after shell quoting, so the variable stays unquoted)."""
    from specdec.models.artifacts import specdec_home

    home = specdec_home()
    for form in {str(home.resolve()), str(home)}:
        if len(form) > 1:
            text = text.replace(form.rstrip("/") + "/", "$SPECDEC_HOME/")
    return text


def shown_path(path) -> str:
    """A path as a report shows it: relative to the working folder when inside it (a report names the
    files of the checkout it ran in, not where that checkout lay on the machine), under the specdec
    home as ``$SPECDEC_HOME/...``."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return shown_home(str(path))


def provenance(command: str | None = None, device=None) -> dict:
    """{"command", "machine", "date", "specdec_version"}; without a ``command``, this process's own
    command line."""
    from specdec import __version__

    return {
        "command": shown_home(command if command is not None else shlex.join(sys.argv)),
        "machine": machine(device),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "specdec_version": __version__,
    }


def machine(device=None) -> dict:
    """The platform, CPU model, core count, torch and transformers versions, and the CUDA device the
    run used (None on a CPU)."""
    import torch
    import transformers

    on_cuda = device is not None and str(device).startswith("cuda") and torch.cuda.is_available()
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(torch.device(device)) if on_cuda else None,
    }


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def plot(report: dict, path: str | Path) -> Path:
    """Bars of each method's speedup and of its quality measure: tau for speculative methods, token
    agreement with the reference for diffusion strategies; per category where the prompts have them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quality = "token_agreement" if report.get("kind") == "diffusion" else "tau"
    methods = [m["method"] for m in report["methods"]]
    cats = ["all"] + sorted({c for m in report["methods"] for c in m.get("by_category", {})} - {"all"})
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(methods)), 4.5))
    width = 0.8 / len(cats)
    for ax, key in zip(axes, ("speedup", quality)):
        for j, c in enumerate(cats):
            vals = [(m if c == "all" else m.get("by_category", {}).get(c, {})).get(key) or 0 for m in report["methods"]]
            ax.bar([i + j * width for i in range(len(methods))], vals, width, label=c)
        ax.set_xticks([i + width * (len(cats) - 1) / 2 for i in range(len(methods))])
        ax.set_xticklabels(methods, rotation=30, ha="right")
        ax.set_title(key.replace("_", " "))
        ax.axhline(1.0, color="gray", lw=0.8)
    if len(cats) > 1:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
