"""generation_config.json defaults against transformers' GenerationConfig reading the same file."""

import json

import pytest
from transformers import GenerationConfig

from lily._core import SamplingParams
from lily.generation_config import load_generation_config


def write(tmp_path, data):
    (tmp_path / "generation_config.json").write_text(json.dumps(data))
    return tmp_path


def hf_effective(folder):
    """What transformers' generate() samples with by default for this file."""
    g = GenerationConfig.from_pretrained(folder)
    # transformers 5 leaves unset fields None and fills them at generate() time from these.
    defaults = GenerationConfig._get_default_generation_params()

    def get(key, fallback=None):
        value = getattr(g, key)
        return value if value is not None else defaults.get(key, fallback)

    if not get("do_sample"):
        return {"temperature": 0.0, "repetition_penalty": get("repetition_penalty")}
    return {"temperature": get("temperature"), "top_k": get("top_k") or 0, "top_p": get("top_p"),
            "min_p": get("min_p", 0.0) or 0.0, "repetition_penalty": get("repetition_penalty")}


@pytest.mark.parametrize(
    "data",
    [
        # The shape of Qwen3.5 / Qwen3.6 releases: sampling on, all knobs given.
        {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95, "eos_token_id": [248046, 248044],
         "pad_token_id": 248044, "repetition_penalty": 1.0},
        {"do_sample": True, "top_p": 0.8},  # omitted knobs take transformers' defaults (T=1, top_k=50)
        {"do_sample": True, "temperature": 0.7, "min_p": 0.05, "top_k": 0},
        {"temperature": 0.7, "top_p": 0.9},  # do_sample absent: transformers is greedy
        {"do_sample": False, "repetition_penalty": 1.1, "eos_token_id": 7},
    ],
)
def test_matches_transformers(tmp_path, data):
    folder = write(tmp_path, data)
    ours = load_generation_config(folder)
    want = hf_effective(folder)
    for key, value in want.items():
        assert getattr(ours, key) == pytest.approx(value), key
    eos = data.get("eos_token_id")
    assert ours.eos_token_ids == ([] if eos is None else eos if isinstance(eos, list) else [eos])
    SamplingParams(**ours.sampling_kwargs()).validate()  # usable as-is by the native sampler


def test_absent_file_is_greedy(tmp_path):
    d = load_generation_config(tmp_path)
    assert d.temperature == 0.0 and d.eos_token_ids == [] and d.source is None
    assert load_generation_config(None).temperature == 0.0


@pytest.mark.parametrize(
    "data,field",
    [
        ({"do_sample": True, "temperature": -1}, "temperature"),
        ({"do_sample": True, "top_p": 0}, "top_p"),
        ({"do_sample": True, "top_k": 2.5}, "top_k"),
        ({"repetition_penalty": "high"}, "repetition_penalty"),
        ({"eos_token_id": ["x"]}, "eos_token_id"),
        ({"do_sample": "yes"}, "do_sample"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_values_name_the_field(tmp_path, data, field):
    with pytest.raises(ValueError, match=field):
        load_generation_config(write(tmp_path, data))


def test_bad_json(tmp_path):
    (tmp_path / "generation_config.json").write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_generation_config(tmp_path)
