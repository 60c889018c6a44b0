"""Options are declared once (``decode.options.opt``): validation reads their ranges and choices, and
``specdec decode``'s drafting flags are made from their declarations (``cli.options.declared_flags``)."""

import dataclasses
import re
from dataclasses import dataclass

import pytest
import typer
from typer.testing import CliRunner

from conftest import invoke

from specdec.cli.options import declared_flags
from specdec.decode.jobs.validate import validate_options
from specdec.decode.options import PIECES, DecodeOptions, DraftingOptions, Range, flag, opt
from specdec.models.errors import UsageError


def _declared():
    for piece, cls in PIECES.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("range") is not None or f.metadata.get("choices"):
                yield piece, f


def _outside(rng: Range):
    """Values just outside a declared range (and a wrong type), each of which it must refuse."""
    bad = []
    if rng.lo is not None:
        bad.append(rng.lo if rng.open_lo else rng.lo - (1 if rng.integer else 0.5))
    if rng.hi is not None:
        bad.append(rng.hi if rng.open_hi else rng.hi + (1 if rng.integer else 0.5))
    bad.append(1.5 if rng.integer else "x")
    if not rng.integer and not rng.infinite:
        bad.append(float("inf"))
    return bad


def _inside(rng: Range):
    """The declared ends a range includes, which it must accept."""
    good = [v for v, open_end in ((rng.lo, rng.open_lo), (rng.hi, rng.open_hi)) if v is not None and not open_end]
    if rng.infinite:
        good.append(float("inf"))
    return good


FIELDS = list(_declared())


@pytest.mark.parametrize("piece,field", FIELDS, ids=[f.name for _, f in FIELDS])
def test_every_declared_range_and_choice_is_what_validation_checks(piece, field):
    rng, choices = field.metadata.get("range"), field.metadata.get("choices")
    base = DecodeOptions(drafter="ar")
    for value in _outside(rng) if rng else ["no-such-choice"]:
        with pytest.raises(UsageError, match=re.escape(flag(field.name))) as info:
            validate_options(dataclasses.replace(base, **{field.name: value}))
        assert "got" in str(info.value)
    for value in _inside(rng) if rng else list(choices):
        changes = {field.name: value}
        if field.name == "beam_groups":
            changes["beams"] = max(2, value)  # groups must divide the beams, and apply to beam search only
        if field.name == "diversity_penalty" and value:
            changes.update(beams=2, beam_groups=2)
        if field.name == "first_finish" and value:
            changes["temperature"] = 0.7
        validate_options(dataclasses.replace(base, **changes))


def test_every_drafting_option_is_reachable_from_the_command_line():
    """Each drafting option is a flag of ``specdec decode`` (its declaration has help) or a method-spec key
    (declared ``spec_only``); none is declared without a way to set it."""
    unreachable = [f.name for f in dataclasses.fields(DraftingOptions)
                   if f.name != "drafter" and not f.metadata.get("help") and not f.metadata.get("spec_only")]
    assert not unreachable


def test_decode_has_a_flag_for_each_declared_drafting_option():
    from specdec.cli.main import app

    out = CliRunner().invoke(app, ["decode", "--help"], env={"COLUMNS": "240"}).output
    for f in dataclasses.fields(DraftingOptions):
        if f.metadata.get("help"):
            assert flag(f.name) in out, f.name
        if f.metadata.get("spec_only"):
            assert flag(f.name).split("=")[0] not in out


@dataclass(frozen=True)
class _Example:
    width: int | None = opt(range=Range(1, 8, integer=True), short="-w", help="How wide.")
    shape: str | None = opt(choices=("round", "square"), help="Which shape.")
    quick: bool = opt(False, help="Be quick.")
    hidden: int = opt(3, spec_only=True)
    plain: int = 0


def test_a_new_declared_option_becomes_a_flag_without_a_cli_change():
    app = typer.Typer()
    seen = {}

    @app.command()
    @declared_flags(_Example)
    def run(name: str = "x", **declared) -> None:
        seen.update(declared, name=name)

    @app.command()
    def other() -> None:  # a second command, so that ``run`` is invoked by name as decode is
        pass

    runner = CliRunner()
    res = runner.invoke(app, ["run", "-w", "3", "--shape", "square", "--quick"])
    assert res.exit_code == 0, res.output
    assert seen == {"name": "x", "width": 3, "shape": "square", "quick": True}
    assert isinstance(seen["shape"], str) and not hasattr(seen["shape"], "value")
    seen.clear()
    assert runner.invoke(app, ["run"]).exit_code == 0
    assert seen == {"name": "x", "width": None, "shape": None, "quick": False}
    res = runner.invoke(app, ["run", "--shape", "oval"])
    assert res.exit_code == 2 and "oval" in res.output
    for absent in (["--hidden", "1"], ["--plain", "1"]):
        assert runner.invoke(app, ["run", *absent]).exit_code == 2


def test_train_draft_flags_are_its_settings_and_their_ranges_refuse_before_loading(tmp_path):
    """train-draft's own flags are made from ``DraftSettings``; a value out of its declared range is one
    ``error:`` line, exit 2, before any model loads (the target named does not exist)."""
    from specdec.cli.main import app
    from specdec.train.settings import DraftSettings

    runner = CliRunner()
    out = runner.invoke(app, ["train-draft", "--help"], env={"COLUMNS": "240"}).output
    for f in dataclasses.fields(DraftSettings):
        if f.metadata.get("help"):
            assert flag(f.name) in out, f.name
    assert "--no-lora" in out  # switches may be turned off over a recipe that turns them on
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "x"}\n')
    for args, message in ((["--kd-weight", "1.5"], "--kd-weight must be in [0, 1], got 1.5"),
                          (["--temperature", "0"], "--temperature must be a finite number > 0, got 0"),
                          (["--window", "0", "--long-context"], "--window must be a positive integer, got 0"),
                          (["--ce-labels", "teacher"], "teacher")):
        res = invoke(["train-draft", "--target", tmp_path / "absent", "--data", data, "--out", tmp_path / "out", *args])
        assert res.exit_code == 2, res.output
        assert [line for line in res.output.splitlines() if line.startswith("error:")] and "Traceback" not in res.output
        assert message in " ".join(res.output.split()), res.output
        assert not (tmp_path / "out").exists()


def test_train_acceptance_flags_and_recipe_keys_are_its_settings(tmp_path):
    """train-acceptance's flags are made from ``AcceptanceSettings`` too, and a recipe section's keys are
    read by the same names (unknown keys left to the section's other readers)."""
    from specdec.cli.main import app
    from specdec.train.recipe import acceptance_knobs, draft_knobs
    from specdec.train.settings import AcceptanceSettings

    out = CliRunner().invoke(app, ["train-acceptance", "--help"], env={"COLUMNS": "240"}).output
    for f in dataclasses.fields(AcceptanceSettings):
        if f.metadata.get("help"):
            assert flag(f.name) in out, f.name
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "x"}\n')
    res = invoke(["train-acceptance", "--target", tmp_path / "absent", "--draft", tmp_path / "absent", "--data", data,
                  "--out", tmp_path / "out", "--reject-weight", "0"])
    assert res.exit_code == 2 and "--reject-weight must be a finite number > 0, got 0" in " ".join(res.output.split()), res.output
    assert acceptance_knobs({"reject_weight": 3.0, "num_heads": 4}) == {"reject_weight": 3.0}
    assert draft_knobs({"kd_weight": 0.5, "lora": True, "unit_size": 3}) == {"kd_weight": 0.5, "lora": True}


@pytest.mark.parametrize("command, settings, required, bad, message", [
    ("train-lud", "LudSettings", ["--target", "{absent}", "--data", "{data}", "--out", "{out}"],
     ["--unit-size", "1"], "--unit-size must be an integer >= 2 (1 is ordinary decoding), got 1"),
    ("train-lud", "LudSettings", ["--target", "{absent}", "--data", "{data}", "--out", "{out}"],
     ["--lora-alpha", "0"], "--lora-alpha must be a finite number > 0, got 0"),
    ("train-dllm", "DllmSettings", ["--target", "{absent}", "--data", "{data}", "--out", "{out}"],
     ["--block-size", "0"], "--block-size must be a positive integer, got 0"),
    ("train-dllm", "DllmSettings", ["--target", "{absent}", "--data", "{data}", "--out", "{out}"],
     ["--list-tasks", "-1"], "--list-tasks must be an integer >= 0, got -1"),
    ("train-filter", "FilterSettings", ["--target", "{absent}", "--data", "{data}", "--out", "{out}"],
     ["--gen-length", "0"], "--gen-length must be a positive integer, got 0"),
])
def test_lud_dllm_and_filter_flags_are_their_settings(tmp_path, command, settings, required, bad, message):
    """train-lud, train-dllm and train-filter make their own flags from their settings (``train.settings``) like
    the other trainers: every declared setting is a flag, a value out of its range is one ``error:`` line, exit
    2, before anything loads or is written."""
    from specdec.cli.main import app
    from specdec.train import settings as declared

    cls = getattr(declared, settings)
    out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "240"}).output
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help") and flag(f.name) in out, f.name
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "x", "text": "x"}\n')
    paths = {"absent": tmp_path / "absent", "data": data, "out": tmp_path / "out"}
    res = invoke([command, *[a.format(**paths) for a in required], *bad])
    assert res.exit_code == 2, res.output
    assert [line for line in res.output.splitlines() if line.startswith("error:")] and "Traceback" not in res.output
    assert message in " ".join(res.output.split()), res.output
    assert not (tmp_path / "out").exists()


def test_the_trainers_check_their_settings_where_they_are_declared():
    """The trainers' own configs are checked by the same declarations as the flags (one place validates)."""
    from specdec.train.trainers.dllm import DllmTrainConfig
    from specdec.train.trainers.filter import FilterTrainConfig

    with pytest.raises(UsageError, match="--attention must be one of block, bidirectional"):
        DllmTrainConfig(attention="causal")
    with pytest.raises(UsageError, match="--cache must be one of none, prefix"):
        FilterTrainConfig(cache="all")
    assert DllmTrainConfig(cf_cache="prefix").cf_cache == "prefix"
