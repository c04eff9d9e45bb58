import math

import pytest

from ferryman.sampling_params import SamplingParams


def test_defaults_match_the_interface_contract():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1.0, 1.0, -1, 0.0, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.stop, p.stop_token_ids, p.max_tokens, p.ignore_eos) == ([], [], 16, False)
    assert (p.logprobs, p.logits_processors) == (None, [])
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_lists_are_not_shared_and_a_single_stop_string_is_a_list():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5),
    ("min_p", -0.1), ("min_p", 1.1), ("max_tokens", 0), ("max_tokens", True),
    ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("logprobs", -1), ("seed", 2**64), ("seed", "7"), ("ignore_eos", 1),
    ("stop", [""]), ("stop_token_ids", [-1]), ("logits_processors", ["mask"]),
])
def test_bad_values_raise_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value})
    assert field in str(err.value)
    assert repr(value).strip("[]") in str(err.value)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(top_p=1.0), dict(top_k=0), dict(top_k=1), dict(min_p=1.0),
    dict(seed=-1), dict(seed=2**64 - 1), dict(presence_penalty=-2.0), dict(logprobs=0),
    dict(stop_token_ids=[0, 2]), dict(max_tokens=1),
])
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)
