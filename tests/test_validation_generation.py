"""GenerationSettings refuse meaningless values at construction, naming the field."""

import dataclasses
import math

import pytest

from mergelab.candidate import GenerationSettings


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens must be >= 1, got -1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer, got 2.5"),
        ({"batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"do_sample": True, "temperature": 0.0}, "temperature must be > 0 when sampling"),
        ({"do_sample": True, "temperature": -1.0}, "temperature must be > 0 when sampling"),
        ({"temperature": math.nan}, "temperature must be a finite number"),
        ({"top_p": 1.5}, r"top_p must lie in \(0, 1\], got 1.5"),
        ({"top_p": 0.0}, r"top_p must lie in \(0, 1\], got 0"),
        ({"top_k": -1}, "top_k must be >= 0, got -1"),
        ({"seed": "0"}, "seed must be an integer, got '0'"),
        ({"do_sample": "yes"}, "do_sample must be True or False"),
        ({"stop_strings": ("###", "")}, "stop_strings must be non-empty strings"),
    ],
)
def test_bad_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationSettings(**kwargs)


def test_good_settings_and_edge_values_are_kept():
    s = GenerationSettings(max_new_tokens=1, batch_size=1, temperature=0.0, top_k=0, top_p=1.0)
    assert s.temperature == 0.0  # ignored by greedy decoding, so allowed
    assert GenerationSettings(stop_strings="###").stop_strings == ("###",)  # not one per character
    assert GenerationSettings(stop_strings=["a", "b"]).stop_strings == ("a", "b")
    assert GenerationSettings.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="batch_size"):  # replace() checks too
        dataclasses.replace(s, batch_size=0)
