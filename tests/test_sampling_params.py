import math

import msgpack
import msgspec
import pytest

from pagedserve.pipeline.sampling_params import SamplingParams


def test_defaults_validate():
    p = SamplingParams().validate()
    assert p.n == 1 and p.top_k is None and not p.greedy  # unset: the model's default
    assert p.with_defaults().top_k == -1  # or, without one, disabled


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=2.5), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(n=0), "n"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(seed=2**63), "seed"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),
])
def test_invalid_fields_name_the_cause(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs).validate()


def test_stop_token_ids_checked_against_vocab():
    with pytest.raises(ValueError, match="stop_token_ids.*100"):
        SamplingParams(stop_token_ids=[100]).validate(vocab_size=100)


def test_top_k_zero_means_disabled_and_stop_string_becomes_list():
    p = SamplingParams(top_k=0, stop="###")
    assert p.top_k == -1 and p.stop == ["###"]


def test_wire_roundtrip_is_plain_msgpack():
    p = SamplingParams(temperature=0.0, stop=["a"], seed=7)
    raw = msgspec.msgpack.encode(p)
    assert msgpack.unpackb(raw) == {"temperature": 0.0, "stop": ["a"], "seed": 7}
    assert msgspec.msgpack.decode(raw, type=SamplingParams) == p
