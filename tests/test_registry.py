"""Building compressors by name or byteps-style dict, and the errors for bad input."""
import pytest
import torch

from adtopk_ps.compression import COMPRESSORS, ADTopk, ErrorFeedback, create, parameters

NAMES = ["none", "topk", "threshold", "adtopk", "adtopk-i", "randomk", "dgc", "gaussiank"]


def test_every_documented_name_is_registered():
    assert sorted(COMPRESSORS) == sorted(NAMES)
    for name in NAMES:
        assert create(name).name == name


def test_byteps_dict_with_error_feedback():
    comp = create({"compressor": "adtopk", "k": 0.01, "ef": "vanilla"})
    assert isinstance(comp, ErrorFeedback) and isinstance(comp.base, ADTopk)
    assert comp.ratio == 0.01
    assert create({"compressor": "topk", "ratio": 0.2}, value_dtype="fp16").value_dtype == torch.float16


@pytest.mark.parametrize("spec, params, words", [
    ("zip", {}, ["unknown compressor 'zip'", "adtopk", "gaussiank"]),
    (42, {}, ["unknown compressor 42"]),
    ("adtopk", {"ratio": 0}, ["ratio must be a number in (0, 1]"]),
    ("adtopk", {"ratio": 1.5}, ["ratio must be a number in (0, 1]"]),
    ("adtopk", {"ratio": "0.1"}, ["ratio must be a number"]),
    ("adtopk", {"layout": "cols"}, ["layout must be one of ['axis', 'rows']"]),
    ("topk", {"value_dtype": "int8"}, ["value_dtype must be one of", "fp16"]),
    ("topk", {"momentum": "nesterov"}, ["does not take ['momentum']", "'ratio'", "'ef'"]),
    ("topk", {"ef": "fancy"}, ["ef must be one of ['none', 'vanilla']"]),
    ("topk", {"k": 0.1, "ratio": 0.1}, ["only one of 'k' and 'ratio'"]),
    ("threshold", {"tau": 0}, ["tau must be a positive integer"]),
    ("randomk", {"seed": -1}, ["seed must be a non-negative integer"]),
    ("dgc", {"sample_ratio": 2}, ["sample_ratio must be a number in (0, 1]"]),
    ({"k": 0.1}, {}, ["needs a 'compressor' key"]),
])
def test_bad_specs_name_what_is_wrong(spec, params, words):
    with pytest.raises(ValueError) as err:
        create(spec, **params)
    for word in words:
        assert word in str(err.value)


def test_parameters_lists_what_each_compressor_takes():
    assert parameters("adtopk") == ["ratio", "layout", "value_dtype", "refill"]
    assert parameters("none") == ["value_dtype"]
