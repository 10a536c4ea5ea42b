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
- Only the HF *save* differs, for memory: make_checkpoint saves with `save_pretrained` (which
  writes per-expert tensors) and then loads everything back to fuse the experts. For medium
  (8.7 GB of bf16) that holds the model, the loaded tensors and the fused copies at once
  (~24 GB), more than this 23 GB machine has. transformers keeps the experts fused in memory
  already (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I] = the released layout),
  so we stream `state_dict()` straight into one safetensors file, one tensor at a time: peak
  memory = the model. config.json comes from the model's config and make_checkpoint's own
  release-field patch, as in its save path.
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(HERE))

MODEL_TYPE = "qwen3_5_moe"
GROUP_SIZE = 64

_ST_DTYPE = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


def _stream_safetensors(state_dict: dict, path: Path) -> None:
    """Write tensors to one safetensors file without ever holding a second copy of them."""
    import torch

    header, offset = {}, 0
    names = sorted(state_dict)
    for k in names:
        t = state_dict[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPE[str(t.dtype)], "shape": list(t.shape),
                     "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for k in names:
            t = state_dict[k].contiguous().reshape(-1)
            f.write(memoryview(t.view(torch.uint8).numpy()))


def make_hf(size: str, out: Path, seed: int = 0) -> Path:
    """The HF checkpoint (released layout, fused experts) of make_checkpoint's `size` dims."""
    import make_checkpoint as mc

    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = mc.build_model(MODEL_TYPE, size, seed=seed)
    _, interval = mc.build_config(MODEL_TYPE, size)
    sd = {k: v for k, v in model.state_dict().items()}
    _stream_safetensors(sd, tmp / "model.safetensors")
    # The two fields save_pretrained adds (llama.cpp's converter picks its class by
    # `architectures`).
    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    model.config.save_pretrained(str(tmp))
    gen = {"do_sample": False, "eos_token_id": model.config.get_text_config().eos_token_id}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    del sd, model
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
    code = ("import sys; sys.path.insert(0, %r); import make_checkpoint as mc; "
            "from pathlib import Path; mc.quantize_checkpoint(Path(%r), Path(%r), bits=%d, "
            "group_size=%d)" % (str(ROOT / "scripts"), str(hf), str(tmp), bits, GROUP_SIZE))
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
    ap.add_argument("-j", "--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    if a.hf_only:
        print(make_hf(a.size, a.root / a.size / "hf"))
        return 0
    for k, p in ensure(a.size, a.root, not a.no_gguf, a.jobs).items():
        print(k, p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
