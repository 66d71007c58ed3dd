from dataclasses import dataclass, field
from typing import Literal

import pytest

from posttrain.core.schema import build, coerce, describe, option, to_dict


@dataclass
class Inner:
    k: int = 1


@dataclass
class Cfg:
    rate: float = option(0.5, ge=0.0, le=1.0, help="a rate")
    steps: int = option(3, gt=0)
    mode: Literal["a", "b"] = "a"
    name: str | None = None
    flag: bool = False
    tags: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)

    def validate(self):
        return ["steps: must be odd"] if self.steps % 2 == 0 else []


def test_defaults_and_conversions():
    cfg, errors = build(Cfg, {"rate": 1, "tags": ["x"], "inner": {"k": 4}, "name": "n"}, "sec")
    assert errors == []
    assert cfg.rate == 1.0 and isinstance(cfg.rate, float)
    assert cfg.tags == ["x"] and cfg.inner.k == 4 and cfg.name == "n"


def test_yaml_style_exponent_string_is_a_float():
    cfg, errors = build(Cfg, {"rate": "1e-3"}, "sec")
    assert errors == [] and cfg.rate == pytest.approx(1e-3)


def test_every_error_is_reported_with_its_path():
    cfg, errors = build(Cfg, {"rate": 2.0, "steps": "x", "mode": "c", "flag": "yes", "tags": [1],
                              "inner": {"kk": 1}, "bogus": 1}, "sec")
    assert cfg is None
    joined = "\n".join(errors)
    assert len(errors) == 7, errors
    for needle in ("sec.rate: 2.0 is out of range (must be <= 1.0)", "sec.steps: expected an integer",
                   "sec.mode: 'c' is not one of 'a', 'b'", "sec.flag: expected true or false",
                   "sec.tags.0: expected a string", "sec.inner.kk: unknown key", "sec.bogus: unknown key"):
        assert needle in joined


def test_unknown_key_suggests_the_closest():
    _, errors = build(Cfg, {"stesp": 3}, "sec")
    assert "Did you mean 'steps'?" in errors[0] and "Valid keys: rate, steps" in errors[0]


def test_bool_is_not_an_int():
    _, errors = build(Cfg, {"steps": True}, "sec")
    assert errors and "expected an integer" in errors[0]


def test_validate_runs_after_fields_and_prefixes_path():
    _, errors = build(Cfg, {"steps": 4}, "sec")
    assert errors == ["sec.steps: must be odd"]


def test_not_a_mapping():
    _, errors = build(Cfg, [1, 2], "sec")
    assert errors == ["sec: expected a mapping of rate, steps, mode, name, flag, tags, inner, got list"]


def test_optional_union():
    assert coerce(None, int | None, "p") == (None, [])
    assert coerce(3, int | None, "p") == (3, [])
    assert coerce("x", int | None, "p")[1]


def test_describe_and_to_dict():
    rows = {r["name"]: r for r in describe(Cfg)}
    assert rows["rate"]["help"] == "a rate" and rows["rate"]["default"] == "0.5"
    assert rows["mode"]["type"] == "'a' | 'b'"
    assert to_dict(Cfg())["inner"] == {"k": 1}
