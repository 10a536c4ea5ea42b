"""Sampling defaults from a checkpoint's `generation_config.json`.

transformers' semantics, so lily samples as `model.generate()` would by default:
- no file, or `do_sample` false/absent: greedy (temperature 0); `repetition_penalty` still applies;
- `do_sample: true`: the file's temperature / top_k / top_p / min_p, and for fields it omits
  transformers' GenerationConfig defaults (temperature 1.0, top_k 50, top_p 1.0, min_p off);
- `eos_token_id` (int or list) adds end-of-sequence ids; `max_new_tokens` / `max_length` are
  kept for the caller to use as a default limit.

`GenerationDefaults.sampling_kwargs()` gives keyword arguments for `lily._core.SamplingParams`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lily.files import read_json

__all__ = ["GenerationDefaults", "load_generation_config"]

# transformers.GenerationConfig defaults for fields a sampling config leaves out.
_HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0}


@dataclass
class GenerationDefaults:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    eos_token_ids: list[int] = field(default_factory=list)
    max_new_tokens: int | None = None
    max_length: int | None = None
    source: str | None = None  # the file these came from, if any

    def sampling_kwargs(self) -> dict:
        d = asdict(self)
        return {k: d[k] for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                  "presence_penalty", "frequency_penalty")}


def _number(data: dict, key: str, path: Path, *, integer: bool = False, lo=None, hi=None, lo_open=False):
    v = data[key]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and integer:
        ok = float(v).is_integer()
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v <= hi
    if not ok:
        raise ValueError(f"{path}: {key} has a bad value {v!r}")
    return int(v) if integer else float(v)


def load_generation_config(path: str | os.PathLike | None) -> GenerationDefaults:
    """Defaults from `path` (a generation_config.json, or a folder holding one); greedy when
    path is None or the folder has no such file."""
    if path is None:
        return GenerationDefaults()
    p = Path(path)
    if p.is_dir():
        p = p / "generation_config.json"
        if not os.path.lexists(p):
            return GenerationDefaults()
    data = read_json(p, ValueError)
    if not isinstance(data, dict):
        raise ValueError(f"{p}: expected a JSON object")

    out = GenerationDefaults(source=str(p))
    if data.get("do_sample") is True:
        sampling = {**_HF_SAMPLING_DEFAULTS, **{k: data[k] for k in _HF_SAMPLING_DEFAULTS if data.get(k) is not None}}
        out.temperature = _number(sampling, "temperature", p, lo=0)
        out.top_k = _number(sampling, "top_k", p, integer=True, lo=0)
        out.top_p = _number(sampling, "top_p", p, lo=0, hi=1, lo_open=True)
        out.min_p = _number(sampling, "min_p", p, lo=0, hi=1)
    elif data.get("do_sample") not in (None, False):
        raise ValueError(f"{p}: do_sample must be true or false, got {data['do_sample']!r}")
    for key in ("repetition_penalty",):
        if data.get(key) is not None:
            out.repetition_penalty = _number(data, key, p, lo=0, lo_open=True)
    for key in ("presence_penalty", "frequency_penalty"):
        if data.get(key) is not None:
            setattr(out, key, _number(data, key, p))
    for key in ("max_new_tokens", "max_length"):
        if data.get(key) is not None:
            setattr(out, key, _number(data, key, p, integer=True, lo=1))
    eos = data.get("eos_token_id")
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"{p}: eos_token_id must be an id or a list of ids, got {eos!r}")
        out.eos_token_ids = list(dict.fromkeys(ids))
    return out
