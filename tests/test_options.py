"""Options: one place for defaults; every option described; bad values named by path."""
from __future__ import annotations

import dataclasses
import typing

import pytest

from runtime import options as O


@pytest.mark.parametrize("cls", [O.SamplingOptions, O.OffloadOptions, O.DraftOptions])
def test_every_option_has_a_default_and_a_description(cls):
    for name, default, meta in O.describe(cls):
        assert meta["help"] and meta["help"].endswith("."), name
        if meta.get("choices"):
            assert default in meta["choices"], name


def test_round_trip_through_plain_data():
    opts = O.LoadOptions(offload=O.OffloadOptions(vram_budget_gb=12.5, placement="cpu"),
                         draft=O.DraftOptions(mode="model", model="tiny", draft_tokens=6, adaptive=False))
    assert O.from_dict(O.LoadOptions, O.to_dict(opts)) == opts


def test_missing_keys_take_defaults_and_whole_floats_pass_as_ints():
    s = O.from_dict(O.SamplingOptions, {"max_tokens": 64.0, "temperature": 0})
    assert s.max_tokens == 64 and s.temperature == 0.0 and s.top_p == O.SamplingOptions().top_p


@pytest.mark.parametrize("data,needle", [
    ({"temperature": "hot"}, "temperature: expected a number"),
    ({"temperature": -1}, "temperature: -1.0 is below the minimum 0.0"),
    ({"top_k": 1.5}, "top_k: expected a whole number"),
    ({"seed": True}, "seed: expected a whole number"),
    ({"stop": "x"}, "stop: expected a list of strings"),
    ({"bogus": 1}, "unknown option(s) bogus"),
])
def test_bad_values_are_named(data, needle):
    with pytest.raises(O.OptionError) as e:
        O.from_dict(O.SamplingOptions, data)
    assert needle in str(e.value)


def test_nested_paths_in_errors():
    with pytest.raises(O.OptionError) as e:
        O.from_dict(O.LoadOptions, {"offload": {"context_length": 10}}, "load")
    assert e.value.path == "load.offload.context_length"


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        O.SamplingOptions().temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("cls", [O.SamplingOptions, O.OffloadOptions, O.DraftOptions])
def test_every_numeric_option_has_both_bounds(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if tp in (int, float, typing.Optional[int], typing.Optional[float]):
            assert f.metadata["min"] is not None and f.metadata["max"] is not None, f.name
            with pytest.raises(O.OptionError, match=f"{f.name}: .* above the maximum"):
                O.from_dict(cls, {f.name: f.metadata["max"] + 1})


def test_stop_strings_are_bounded_and_valid_text():
    with pytest.raises(O.OptionError, match="stop: at most"):
        O.from_dict(O.SamplingOptions, {"stop": ["x"] * (O.MAX_STOP_STRINGS + 1)})
    with pytest.raises(O.OptionError, match=r"stop\[1\]: not valid Unicode"):
        O.from_dict(O.SamplingOptions, {"stop": ["ok", "\udcff"]})
