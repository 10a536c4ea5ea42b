#!/usr/bin/env python3
"""The benchmark checkpoints: one set of random weights, in every engine's format.

    python benchmarks/checkpoints.py --size medium [--root build/bench] [--no-gguf]

For a size (tiny | medium, as scripts/make_checkpoint.py defines them; model_type qwen3_5_moe,
the released Qwen3.5/3.6 MoE layout) this makes, under ROOT/<size>/:

    hf/        Hugging Face checkpoint (medium: bf16, tiny: fp32), fused experts, + tokenizer
    mlx4/      MLX affine 4-bit, group 64 (mlx_lm's converter; scales in the HF dtype, so
               bf16 for medium as in the released mlx-community conversions)   -> lily, mlx-lm
    gguf/      model-q4_0.gguf, model-q8_0.gguf (llama.cpp's converter + llama-quantize)

Design choices:
- The weights come from scripts/make_checkpoint.py (`build_model`: transformers builds the
  model, values seeded per parameter name) and the MLX conversion from its
  `quantize_checkpoint` (mlx_lm's own code path). Nothing about the model is re-implemented.
- Only how the HF checkpoint is *written* differs, for memory: make_checkpoint builds the whole
  model, saves it with `save_pretrained` (per-expert tensors) and loads it all back to fuse the
  experts. For medium (8.7 GB of bf16) that needs ~24 GB at once; this machine has 23 GB,
  shared (the OOM killer stopped it twice). Its values are a pure function of (seed, parameter
  name) (`_fill`), so we take names, shapes and dtypes from the transformers model built on the
  meta device (no memory), and write each tensor as soon as it is filled: peak memory = one
  tensor. transformers' own parameter names are the released layout (experts fused as
  `mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]). On tiny the file is checked
  byte-identical (tensors, config.json, generation_config.json) to make_checkpoint's.
- The tokenizer (needed by llama.cpp's converter only) is scripts/make_tokenizer.py's
  Qwen3.5 tokenizer.json. A size whose vocab is smaller than the tokenizer (tiny: 503) gets no
  GGUF: llama.cpp would need a tokenizer that matches the vocabulary.
- Each stage is skipped when its output exists (delete ROOT/<size> to rebuild); outputs are
  written under a temporary name and renamed, so an interrupted run leaves no half checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(HERE))

MODEL_TYPE = "qwen3_5_moe"
GROUP_SIZE = 64

_ST_DTYPE = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


def _stream_safetensors(specs: dict, make, path: Path) -> None:
    """Write one safetensors file tensor by tensor: specs {name: (shape, torch dtype)},
    make(name) -> the tensor. Only one tensor is ever in memory."""
    import torch

    header, offset = {}, 0
    names = sorted(specs)
    for k in names:
        shape, dtype = specs[k]
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[k] = {"dtype": _ST_DTYPE[str(dtype)], "shape": list(shape),
                     "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for k in names:
            t = make(k).contiguous().reshape(-1)
            assert t.dtype == specs[k][1] and t.numel() * t.element_size() == (
                header[k]["data_offsets"][1] - header[k]["data_offsets"][0]), k
            f.write(memoryview(t.view(torch.uint8).numpy()))
            del t


def make_hf(size: str, out: Path, seed: int = 0, dtype: str | None = None) -> Path:
    """The HF checkpoint (released layout, fused experts) of make_checkpoint's `size` dims,
    with make_checkpoint's values (its per-name generator), written one tensor at a time."""
    import make_checkpoint as mc
    import torch
    import transformers as tf

    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cfg, interval = mc.build_config(MODEL_TYPE, size)
    dtype = getattr(torch, dtype or ("bfloat16" if size == "medium" else "float32"))  # as mc
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):  # names, shapes and dtypes only: no memory
            model = tf.Qwen3_5MoeForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(prev)
    params = dict(model.named_parameters())
    if set(params) != set(model.state_dict()):  # make_checkpoint randomizes parameters only
        raise RuntimeError("state_dict holds non-parameter tensors; streaming save would miss them")
    specs = {k: (tuple(p.shape), p.dtype) for k, p in params.items()}
    # make_checkpoint.build_model's one dtype exception: A_log stays fp32 (as in releases).
    specs.update({k: (s, torch.float32) for k, (s, _) in specs.items() if k.endswith(".A_log")})
    _stream_safetensors(
        specs, lambda k: mc._fill(mc.canonical_name(k), specs[k][0], seed).to(specs[k][1]),
        tmp / "model.safetensors")
    # The two fields save_pretrained adds (llama.cpp's converter picks its class by
    # `architectures`).
    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(dtype).removeprefix("torch.")
    model.config.use_cache = True
    model.config.save_pretrained(str(tmp))
    gen = {"do_sample": False, "eos_token_id": model.config.get_text_config().eos_token_id}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    mc._patch_config(tmp, MODEL_TYPE, interval)
    tmp.rename(out)
    return out


def add_tokenizer(hf: Path) -> bool:
    """Copy the Qwen3.5 tokenizer into `hf` if its vocab can hold it; returns whether it did."""
    import make_tokenizer

    cfg = json.loads((hf / "config.json").read_text())
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    n_tok = make_tokenizer.FIRST_ADDED_ID + len(make_tokenizer.ADDED_TOKENS)
    if vocab < n_tok:
        return False
    if not (hf / "tokenizer.json").is_file():
        tok = make_tokenizer.ensure_tokenizer()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tok / name, hf / name)
    return True


def make_mlx(hf: Path, out: Path, bits: int = 4) -> Path:
    if (out / "config.json").is_file():
        return out
    # In a child process: mlx_lm's conversion holds its own copy of the weights, and the
    # parent may still hold torch's allocator arena from building the model.
    tmp = out.with_name(out.name + ".tmp")
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); "
            f"import make_checkpoint as mc; from pathlib import Path; "
            f"mc.quantize_checkpoint(Path({str(hf)!r}), Path({str(tmp)!r}), bits={bits}, "
            f"group_size={GROUP_SIZE})")
    subprocess.run([sys.executable, "-c", code], check=True)
    tmp.rename(out)
    return out


def ensure(size: str, root: Path, gguf: bool = True, jobs: int = 2) -> dict[str, Path]:
    """All formats of one size; returns {"hf", "mlx4", ["q4_0", "q8_0"]: path}."""
    base = Path(root) / size
    base.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    if not (base / "hf" / "config.json").is_file():
        # Building in a child too: the parent stays small for the benchmark that follows.
        subprocess.run([sys.executable, __file__, "--size", size, "--root", str(root),
                        "--hf-only"], check=True)
    paths["hf"] = base / "hf"
    paths["mlx4"] = make_mlx(paths["hf"], base / "mlx4")
    if gguf and add_tokenizer(paths["hf"]):
        import llamacpp

        paths.update(llamacpp.convert(paths["hf"], base / "gguf", ("q4_0", "q8_0"), jobs=jobs))
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="medium", choices=("tiny", "medium"))
    ap.add_argument("--root", type=Path, default=ROOT / "build" / "bench")
    ap.add_argument("--no-gguf", action="store_true")
    ap.add_argument("--hf-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)  # HF dtype override (for the tiny check)
    ap.add_argument("-j", "--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    if a.hf_only:
        print(make_hf(a.size, a.root / a.size / "hf", dtype=a.dtype))
        return 0
    for k, p in ensure(a.size, a.root, not a.no_gguf, a.jobs).items():
        print(k, p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
