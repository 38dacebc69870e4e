import json

import pytest

from tq_hf_cache import PRESETS, TurboQuantCache, TurboQuantConfig


def test_presets():
    assert set(PRESETS) >= {"k8v4", "k5v3", "k4v4", "k3v4", "k4v2", "k3v3", "k2v2"}
    cfg = TurboQuantConfig.from_preset("k3v4", residual_length=64)
    assert (cfg.key_bits, cfg.value_bits, cfg.residual_length) == (3, 4, 64)
    assert cfg.preset == "k3v4"
    assert TurboQuantConfig().preset == "k5v3"


def test_json_round_trip():
    cfg = TurboQuantConfig(
        key_bits=3, value_bits=2, residual_length=0, seed=9, rotation="orthogonal", norm_dtype="float32",
        skip_first=1, skip_layers=[5, 3], layer_bits={4: [8, 4]},
    )
    s = cfg.to_json_string()
    assert json.loads(s)["tq_hf_cache_config_version"] == 3
    back = TurboQuantConfig.from_json_string(s)
    assert back == cfg and back.skip_layers == [3, 5] and back.layer_bits == {4: [8, 4]}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(key_bits=0), r"key_bits must be an integer in \[1, 8\], got 0"),
        (dict(value_bits=9), r"value_bits must be an integer in \[1, 8\], got 9"),
        (dict(key_bits=4.0), r"key_bits .* got 4.0"),
        (dict(residual_length=-1), r"residual_length must be an integer in \[0, 2147483647\], got -1"),
        (dict(rotation="random"), r"rotation must be one of .* got 'random'"),
        (dict(norm_dtype="bfloat16"), r"norm_dtype must be one of .* got 'bfloat16'"),
        (dict(seed=-3), r"seed must be an integer in \[0, 2\*\*63 - 2\*\*31\] .*got -3"),
        (dict(skip_layers=[-1]), r"skip_layers holds layer indices >= 0, got -1"),
        (dict(layer_bits={2: [4]}), r"layer_bits\[2\] must be \[key_bits, value_bits\]"),
        (dict(layer_bits={2: [4, 12]}), r"layer_bits\[2\] value bits must be an integer in \[1, 8\], got 12"),
    ],
)
def test_bad_configs_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TurboQuantConfig(**kwargs)


def test_bad_json_and_presets():
    with pytest.raises(ValueError, match="unknown preset 'k5v5'"):
        TurboQuantConfig.from_preset("k5v5")
    with pytest.raises(ValueError, match="corrupt"):
        TurboQuantConfig.from_json_string("{not json")
    with pytest.raises(ValueError, match=r"unknown TurboQuantConfig fields \['bits'\]"):
        TurboQuantConfig.from_dict({"bits": 4})
    with pytest.raises(ValueError, match="version 7"):
        TurboQuantConfig.from_dict({"tq_hf_cache_config_version": 7})
    with pytest.raises(TypeError, match="tq_config must be"):
        TurboQuantCache(3.5)
    with pytest.raises(ValueError, match="residual_length"):
        TurboQuantCache("k4v4", residual_length=-5)


def test_layer_policy():
    cfg = TurboQuantConfig(skip_first=1, skip_last=2, skip_layers=[4], layer_bits={2: [8, 8]})
    assert [cfg.bits_for_layer(i, 8) for i in range(8)] == [
        None, (5, 3), (8, 8), (5, 3), None, (5, 3), None, None
    ]
    with pytest.raises(ValueError, match="skip_last needs the model's layer count"):
        cfg.bits_for_layer(3)


def test_an_unknown_model_type_does_not_match_a_known_one():
    from conftest import tiny_llama_config

    from tq_hf_cache.config import fact_mismatch, model_facts

    facts = model_facts(tiny_llama_config())
    assert fact_mismatch(dict(facts), facts) is None
    assert fact_mismatch({**facts, "model_type": None}, facts) == ("model_type", None, "llama")
    assert fact_mismatch(facts, {**facts, "model_type": None}) == ("model_type", "llama", None)
