"""The README and docs/benchmarks.md say only what is true: the page is generated from the committed
reports and not stale, the README is short, carries no development history, and names only options
that the commands it names accept."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SCRIPT = ROOT / "scripts" / "benchmarks-doc"
# options of other programs the README shows specdec running under, or serving its exports
FOREIGN_OPTIONS = {"--num_processes", "--multi_gpu", "--speculative-config", "--model-path", "--speculative-algorithm",
                   "--speculative-draft-model-path", "--speculative-num-steps", "--speculative-eagle-topk",
                   "--speculative-num-draft-tokens", "--spec-type"}
PLACEMENT_USERS = ("decode", "bench", "train-draft", "train-acceptance", "train-heads", "train-dllm", "train-filter")
TRAINERS_WITH_RECIPES = ("train-draft", "train-acceptance", "train-heads")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def command_options() -> dict[str, set[str]]:
    """Each command's option names (``recipe run`` for subcommands), read from the typer app itself."""
    import typer

    from specdec.cli.main import app

    options: dict[str, set[str]] = {}

    def walk(cmd, name: str) -> None:
        if getattr(cmd, "commands", None):
            for sub_name, sub in cmd.commands.items():
                walk(sub, f"{name} {sub_name}".strip())
            return
        names = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
        options[name] = names | {"--help"}

    walk(typer.main.get_command(app), "")
    return options


@pytest.fixture(scope="module")
def options() -> dict[str, set[str]]:
    return command_options()


@pytest.fixture(scope="module")
def readme() -> str:
    return README.read_text(encoding="utf-8")


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


# -- docs/benchmarks.md ----------------------------------------------------------------------------


def test_benchmarks_doc_is_up_to_date():
    proc = run_script("--check")
    assert proc.returncode == 0, f"{proc.stderr}run scripts/benchmarks-doc and commit docs/benchmarks.md and README.md"


def test_committed_reports_are_named_machine_dash_what():
    for path in sorted((ROOT / "benchmarks").glob("*")):
        assert re.fullmatch(r"[a-z0-9][a-z0-9.]*(-[a-z0-9.]+)+\.json", path.name), f"{path.name}: name it <machine>-<what>.json"
        report = json.loads(path.read_text(encoding="utf-8"))
        assert isinstance(report.get("methods") or report.get("rows"), list), f"{path.name}: not a bench report"


def _tmp_readme(tmp_path: Path) -> Path:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Results\n\n<!-- benchmarks-doc: results begin -->\n<!-- benchmarks-doc: results end -->\n")
    return readme


def test_generator_renders_reports_and_detects_staleness(tmp_path):
    reports = tmp_path / "benchmarks"
    reports.mkdir()
    doc, readme = tmp_path / "docs" / "benchmarks.md", _tmp_readme(tmp_path)
    paths = ["--reports", str(reports), "--doc", str(doc), "--readme", str(readme)]

    assert run_script(*paths).returncode == 0
    empty = doc.read_text()
    assert "No reports are committed yet" in empty and "## Adding a report" in empty
    assert "quotes no numbers" in readme.read_text()
    assert run_script("--check", *paths).returncode == 0

    (reports / "cpu2-family.json").write_text(json.dumps({
        "title": "Default family, greedy",
        "command": "specdec bench --methods ar,ngram,hf-lookup --repeats 3 --out benchmarks/cpu2-family.json",
        "machine": "2-core Xeon, no GPU", "date": "2026-01-02",
        "config": {"prompts": 48, "temperature": 0.0, "repeats": 3},
        "methods": [
            {"method": "ar", "tokens_per_s": 80.0, "speedup": 1.0, "tau": 1.0, "distinct4": 0.19, "efficiency": 1.0},
            {"method": "ngram", "tokens_per_s": 400.0, "speedup": 4.5, "tau": 5.6, "distinct4": 0.19, "efficiency": 0.95},
            {"method": "hf-lookup", "tokens_per_s": 500.0, "speedup": 6.0, "tau": None, "distinct4": 0.19, "efficiency": None},
            {"method": "hf-generate", "tokens_per_s": 72.0, "speedup": 0.9, "tau": None, "distinct4": 0.19, "efficiency": None},
        ],
    }))
    # the looping toy family's reports go to a section of their own, out of the README's table
    (reports / "cpu2-tiny-stdlib-t0.json").write_text(json.dumps({
        "command": "specdec bench --target $SPECDEC_HOME/tiny-stdlib/target --methods ar,copy",
        "config": {"target": "$SPECDEC_HOME/tiny-stdlib/target"},
        "methods": [{"method": "ar", "speedup": 1.0, "tau": 1.0}, {"method": "copy", "speedup": 11.0, "tau": 25.0}],
    }))
    # an older report without command, machine or date, from a diffusion LM
    (reports / "cpu2-dllm.json").write_text(json.dumps({
        "config": {"gen_length": 128, "block_size": 32},
        "methods": [{"method": "static", "speedup": 1.0, "steps_per_token": 1.0, "token_agreement": 1.0},
                    {"method": "threshold", "speedup": 1.8, "steps_per_token": 0.5, "token_agreement": 0.93}],
    }))
    stale = run_script("--check", *paths)
    assert stale.returncode == 1 and "stale" in stale.stderr

    assert run_script(*paths).returncode == 0
    assert run_script("--check", *paths).returncode == 0
    text = doc.read_text()
    assert "## Default family, greedy" in text and "`specdec bench --methods ar,ngram,hf-lookup" in text
    assert "2-core Xeon, no GPU" in text and "2026-01-02" in text
    assert "| ngram | 4.50 | 400.0 | 5.60 | 0.190 | 0.95 |" in text
    assert "## cpu2-dllm" in text and text.count("not recorded") == 5  # the dllm report has none, the toy one no machine or date
    assert "| threshold | 0.500 | 93.0% | 1.80 |" in text
    results = readme.read_text()
    # over ar and over transformers' generate, measured in the same run (4.5 / 0.9)
    assert "`ngram` | 4.50 | 5.00 | - | tau 5.60" in results and "hf-lookup" not in results  # peers are not specdec's headline
    assert "`threshold` | 1.80 | - | - | agreement 93.0%" in results
    assert "`copy`" not in results and text.index("a looping toy") < text.index("## cpu2-tiny-stdlib-t0")
    assert text.index("## cpu2-tiny-stdlib-t0") > text.index("## Default family, greedy")


def test_generator_refuses_a_broken_report(tmp_path):
    reports = tmp_path / "benchmarks"
    reports.mkdir()
    (reports / "cpu-bad.json").write_text("{not json")
    proc = run_script("--reports", str(reports), "--doc", str(tmp_path / "b.md"), "--readme", str(_tmp_readme(tmp_path)))
    assert proc.returncode != 0 and "cpu-bad.json" in proc.stderr


# -- the README ------------------------------------------------------------------------------------


def test_readme_is_short(readme):
    assert len(readme.splitlines()) <= 285


def test_readme_has_no_development_history(readme):
    assert not re.search(r"\bsessions?\s+\d+", readme, re.I), "session numbers belong in commit messages"
    hashes = re.findall(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", readme)
    assert not hashes, f"commit hashes in the README: {hashes}"
    scratch = re.findall(r"(?<![\w.-])out/\S*", readme)
    assert not scratch, f"scratch paths in the README: {scratch}"


def _code_and_prose(text: str) -> tuple[list[str], str]:
    """Logical lines of fenced code blocks (backslash and indented continuations joined) and the
    prose outside them."""
    code, prose, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            prose.append(line)
        elif code and (code[-1].endswith("\\") or line[:1].isspace()):
            code[-1] = code[-1].rstrip("\\") + " " + line.strip()
        else:
            code.append(line)
    return code, "\n".join(prose)


def _invocations(text: str, commands) -> list[tuple[str, list[str]]]:
    """(command, options written after it) for every ``[specdec] <command> ...`` in code: the
    options up to the next command or the end of the shell command."""
    names = "|".join(sorted((re.escape(c) for c in commands), key=len, reverse=True))
    code, prose = _code_and_prose(text)
    pieces = code + [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
    found = []
    for piece in pieces:
        for part in re.split(r"&&|;", piece):
            hits = list(re.finditer(rf"(?:^|\s)(?:specdec\s+)?({names})(?=\s|$)", part))
            for hit, nxt in zip(hits, hits[1:] + [None]):
                tail = part[hit.end(): nxt.start() if nxt else len(part)]
                found.append((hit.group(1), OPTION.findall(tail)))
    return found


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def _bullets(section: str) -> list[str]:
    return ["- " + b for b in re.split(r"^- ", section, flags=re.M)[1:]]


def _unknown(found: set[str], allowed: set[str]) -> set[str]:
    return found - allowed - FOREIGN_OPTIONS


def _loose_options(text: str, commands) -> set[str]:
    """Options in prose, leaving out inline invocations of a named command (checked against it)."""
    names = "|".join(re.escape(c) for c in commands)
    return set(OPTION.findall(re.sub(rf"`(?:specdec\s+)?(?:{names})\s[^`]*`", "", text)))


def test_readme_invocations_use_real_options(readme, options):
    seen = _invocations(readme, options)
    assert {c for c, _ in seen} >= {"decode", "bench", "train-draft", "train-heads", "train-acceptance", "train-dllm", "export"}
    for command, opts in seen:
        assert not _unknown(set(opts), options[command]), f"README: `{command}` has no {_unknown(set(opts), options[command])}"


def test_readme_prose_options_belong_to_their_commands(readme, options):
    everything = set().union(*options.values())
    assert not _unknown(set(OPTION.findall(readme)), everything), "README names options no command has"
    for title in ("The JSONL contract (`specdec decode`)", "Diffusion decoding"):
        assert not _unknown(_loose_options(_section(readme, title), options), options["decode"]), title
    shared = set.intersection(*(options[c] for c in PLACEMENT_USERS))
    for bullet in _bullets(_section(readme, "Your own model")):
        if bullet.startswith("- `--"):
            assert not _unknown(_loose_options(bullet, options), shared), bullet
    training = _section(readme, "Training")
    intro = training.split("\n- ", 1)[0]
    assert not _unknown(_loose_options(intro, options), set.intersection(*(options[c] for c in TRAINERS_WITH_RECIPES)))
    described = 0
    for bullet in _bullets(training):
        command = re.match(r"- `([\w-]+)", bullet).group(1)
        if command in options:
            described += 1
            assert not _unknown(set(OPTION.findall(bullet)), options[command]), bullet
    assert described >= 6


def test_makefile_and_ci_use_real_options_and_the_readme_test_command(readme, options):
    makefile = (ROOT / "Makefile").read_text()
    seen = _invocations("```\n" + makefile + "\n```", options)
    assert {c for c, _ in seen} >= {"decode", "bench"}
    for command, opts in seen:
        assert not _unknown(set(opts), options[command]), f"Makefile: `{command}` has no {_unknown(set(opts), options[command])}"
    assert "make test" in readme and re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(), re.M)
