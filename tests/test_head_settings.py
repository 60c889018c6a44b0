"""train-heads' settings are declared once (``train.settings.HeadSettings``): each with its range or choices
and the head kinds it applies to. ``check`` refuses what they rule out before any model loads, train-heads'
flags are made from the declarations, and a recipe section's keys are read by the same names."""

import dataclasses
import re

import pytest
from typer.testing import CliRunner

from conftest import invoke
from specdec.decode.options import flag
from specdec.models.errors import UsageError
from specdec.tests.test_declared_options import _inside, _outside
from specdec.train.settings import HEAD_KINDS, RIDING_KINDS, HeadSettings

FIELDS = dataclasses.fields(HeadSettings)
DECLARED = [f for f in FIELDS if f.metadata.get("range") is not None or f.metadata.get("choices")]
ALL_KINDS = HEAD_KINDS + RIDING_KINDS


def _given(f):
    """A value of ``f`` in its range or choices other than its default: a setting the user gave."""
    rng, choices = f.metadata.get("range"), f.metadata.get("choices")
    if isinstance(f.default, bool):
        return not f.default
    if choices:
        return next(c for c in choices if c != f.default)
    if rng is not None:
        if rng.integer:
            return rng.lo + 1 if rng.lo == f.default else rng.lo
        return rng.hi if rng.hi is not None and rng.hi != f.default else rng.lo + 0.5
    return "x"


def test_the_kinds_are_the_models():
    from specdec.cli.train import HeadKind
    from specdec.models.heads import KINDS, RIDE_KINDS

    assert (HEAD_KINDS, RIDING_KINDS) == (KINDS, RIDE_KINDS)
    assert [k.value for k in HeadKind] == list(ALL_KINDS)
    for f in FIELDS:
        assert f.metadata["kinds"] and set(f.metadata["kinds"]) <= set(ALL_KINDS), f.name


@pytest.mark.parametrize("field", DECLARED, ids=[f.name for f in DECLARED])
def test_every_declared_range_and_choice_is_what_check_refuses(field):
    kind = field.metadata["kinds"][0]
    rng, choices = field.metadata.get("range"), field.metadata.get("choices")
    for value in _outside(rng) if rng else ["no-such-choice"]:
        with pytest.raises(UsageError, match=re.escape(flag(field.name))) as info:
            HeadSettings(**{field.name: value}).check(kind)
        assert "got" in str(info.value)
    for value in _inside(rng) if rng else list(choices):
        HeadSettings(**{field.name: value}).check(kind)


@pytest.mark.parametrize("field", FIELDS, ids=[f.name for f in FIELDS])
def test_a_setting_given_for_a_kind_it_does_not_apply_to_is_refused(field):
    kinds = field.metadata["kinds"]
    value = _given(field)
    for kind in kinds:
        settings = HeadSettings(**{field.name: value})
        settings.check(kind)
        assert field.name in settings.hparams(kind) or field.name in ("draft_vocab", "teacher_cache", "teacher_topk",
                                                                      "charge_teacher", "fspad_align")
    for kind in set(ALL_KINDS) - set(kinds):
        with pytest.raises(UsageError, match=re.escape(f"{flag(field.name)} applies to --kind")) as info:
            HeadSettings(**{field.name: value}).check(kind)
        assert f"not --kind {kind}" in str(info.value)
        HeadSettings(**{field.name: field.default}).check(kind)  # its default is no setting given


def test_combinations_and_kinds_are_checked():
    with pytest.raises(UsageError, match="--layout published"):
        HeadSettings(fspad=True, layout="published").check("eagle")
    with pytest.raises(UsageError, match="--kind must be one of"):
        HeadSettings().check("hydra")
    # the alignment means nothing without FSPAD; the published layout is the only one build_heads is told of
    assert HeadSettings(fspad_align=0.25, layout="specdec").hparams("eagle") == {}
    assert HeadSettings(fspad=True).hparams("eagle") == {"fspad": True, "fspad_align": 0.5}
    assert HeadSettings(layout="published", unroll=3).hparams("eagle") == {"layout": "published", "unroll": 3}


class _Loaded(Exception):
    pass


def test_train_heads_refuses_before_loading_and_takes_its_old_keywords(tmp_path, monkeypatch):
    from specdec.train import data
    from specdec.train.loop import config_from_dict
    from specdec.train.trainers.heads import train_heads

    def load_teacher(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(data, "load_teacher", load_teacher)
    cfg = config_from_dict({"steps": 1})

    def run(kind, **kw):
        train_heads(kind, tmp_path / "absent", [tmp_path / "d.jsonl"], tmp_path / "out", cfg, resume=False, **kw)

    for kind, kw, needle in (("hidden-transfer", {"ensemble": 2}, "--ensemble"), ("ppd", {"draft_vocab": 40}, "--draft-vocab"),
                             ("medusa", {"window": 16}, "--window"), ("eagle", {"noise": -1.0}, "--noise"),
                             ("eagle", {"fspad": True, "layout": "published"}, "--layout published")):
        with pytest.raises(UsageError, match=re.escape(needle)):
            run(kind, **kw)
    with pytest.raises(TypeError):
        run("medusa", no_such_setting=1)
    assert not (tmp_path / "out").exists()
    # the keywords callers give (recipes, the former command line): a None is a setting not given
    for kind, kw in (("medusa", {"num_heads": None, "unroll": None, "ensemble": None, "draft_vocab": 40, "teacher_topk": 8,
                                 "charge_teacher": False, "teacher_cache": tmp_path / "t.safetensors"}),
                     ("eagle", {"eagle3": True, "feature_layers": "eagle3", "unroll": 2, "layout": "published", "fc_norm": True}),
                     ("ppd", {"num_heads": 3, "cuts": 8, "ensemble": 2}), ("clover", {"window": 16})):
        with pytest.raises(_Loaded):
            run(kind, **kw)


def test_train_heads_flags_are_its_settings():
    from specdec.cli.main import app

    out = CliRunner().invoke(app, ["train-heads", "--help"], env={"COLUMNS": "240"}).output
    for f in FIELDS:
        if f.metadata.get("help"):
            assert flag(f.name) in out, f.name
    for name in ("--kind", "--draft-vocab", "--no-fspad", "--no-eagle3"):
        assert name in out


@pytest.mark.parametrize("args,message", [
    (["--kind", "eagle", "--fspad-align", "1.5"], "--fspad-align must be in (0, 1], got 1.5"),
    (["--kind", "medusa", "--num-heads", "0"], "--num-heads must be a positive integer, got 0"),
    (["--kind", "eagle", "--unroll", "0"], "--unroll must be a positive integer, got 0"),
    (["--kind", "ppd", "--ensemble", "0"], "--ensemble must be a positive integer, got 0"),
    (["--kind", "medusa", "--ensemble", "2"], "--ensemble applies to --kind ppd, not --kind medusa"),
    (["--kind", "clover", "--eagle3"], "--eagle3 applies to --kind eagle, not --kind clover"),
    (["--kind", "chimera", "--layout", "published"], "--layout applies to --kind eagle / block, not --kind chimera"),
    (["--kind", "ppd", "--draft-vocab", "64"], "--draft-vocab applies to --kind medusa / clover / eagle / chimera / block, not --kind ppd"),
    (["--kind", "eagle", "--num-heads", "3"], "--num-heads applies to --kind medusa / clover / chimera / block / ppd / hidden-transfer"),
    (["--kind", "eagle", "--fspad", "--layout", "published"], "--fspad cannot train --layout published"),
    (["--kind", "medusa", "--recipe", "RECIPE"], "--num-layers must be a positive integer, got 0"),
])
def test_a_bad_head_setting_is_one_error_line_before_any_model_loads(tmp_path, monkeypatch, args, message):
    from specdec.train import data as train_data

    monkeypatch.setattr(train_data, "load_teacher", lambda *a, **k: pytest.fail("a model was loaded"))
    recipe = tmp_path / "heads.yaml"
    recipe.write_text("medusa:\n  steps: 1\n  extra: {num_heads: 3, num_layers: 0}\n")
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "x"}\n')
    args = [str(recipe) if a == "RECIPE" else a for a in args]
    res = invoke(["train-heads", *args, "--target", tmp_path / "absent", "--data", data, "--out", tmp_path / "out"])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.output, res.stderr
    assert message in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,expected", [
    (["--kind", "medusa"], {"num_heads": 4, "num_layers": 1}),  # the packaged recipe's section, by the settings' names
    (["--kind", "medusa", "--num-heads", "3"], {"num_heads": 3, "num_layers": 1}),  # a flag over the recipe
    (["--kind", "eagle"], {"noise": 0.2, "ce_weight": 0.1, "unroll": 1, "feature_layers": None, "layout": "published"}),
    (["--kind", "eagle", "--layout", "specdec", "--eagle3"], {"noise": 0.2, "ce_weight": 0.1, "unroll": 1,
                                                              "feature_layers": None, "layout": "specdec", "eagle3": True}),
    (["--kind", "eagle", "--fspad-align", "0.25"], {"noise": 0.2, "ce_weight": 0.1, "unroll": 1, "feature_layers": None,
                                                    "fspad": True, "fspad_align": 0.25}),  # an alignment asks for FSPAD
    (["--kind", "ppd", "--ensemble", "2"], {"num_heads": 3, "cuts": 16, "ensemble": 2}),
    (["--kind", "clover", "--draft-vocab", "64", "--teacher-cache", "t.safetensors"],
     {"num_heads": 4, "window": 64, "draft_vocab": 64, "teacher_cache": "t.safetensors"}),
])
def test_train_heads_gets_the_recipes_settings_and_the_flags_given(tmp_path, monkeypatch, args, expected):
    from specdec.train.trainers import heads

    seen = {}
    monkeypatch.setattr(heads, "train_heads", lambda kind, *a, **kw: seen.update(kw) or {})
    res = invoke(["train-heads", *args, "--target", tmp_path / "t", "--data", tmp_path / "d", "--out", tmp_path / "o"])
    assert res.exit_code == 0, res.output
    assert {k: v for k, v in seen.items() if k not in ("resume", "placement")} == expected


def test_a_recipes_layout_stands_unless_a_flag_is_given(tmp_path, monkeypatch):
    from specdec.train.trainers import heads

    seen = {}
    monkeypatch.setattr(heads, "train_heads", lambda kind, *a, **kw: seen.update(kw) or {})
    (tmp_path / "heads.yaml").write_text("eagle:\n  steps: 1\n  extra: {layout: specdec, unroll: 2}\n")
    args = ["train-heads", "--kind", "eagle", "--recipe", tmp_path / "heads.yaml", "--target", tmp_path / "t", "--data",
            tmp_path / "d", "--out", tmp_path / "o"]
    for extra, layout in (([], "specdec"), (["--layout", "published"], "published")):
        assert invoke([*args, *extra]).exit_code == 0
        assert (seen["layout"], seen["unroll"]) == (layout, 2)
