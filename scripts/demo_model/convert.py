"""Quantize the trained demo checkpoint to MLX 4-bit and lay out the shipped files (src/lily/demo/).

mlx-lm's own converter does the quantization, so the demo is byte-for-byte the format of the
released `mlx-community/Qwen3.6-35B-A3B-4bit`: affine 4-bit, group 64, bf16 scales and biases,
the router `mlp.gate` and `mlp.shared_expert_gate` 8-bit (mlx-lm's qwen3_5 quant predicate),
norms stored as 1+w, conv1d as [C, 4, 1], A_log kept fp32, experts stacked as
`mlp.switch_mlp.{gate,up,down}_proj`.

Steps: stage the HF checkpoint (from train.py) with the tokenizer and chat files from this folder,
run mlx_lm.convert into a fresh folder, then write the tokenizer/chat/generation files again from
their sources (mlx-lm's tokenizer.save_pretrained rewrites them in its own way) and drop the model
card. Without --out this refreshes src/lily/demo/.

  python convert.py --hf /path/to/trained/checkpoint [--out ../../src/lily/demo]
  python convert.py --hf /path/to/ckpt --random-twin --out /tmp/twin   # same config, random init
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EOT_ID, IM_END_ID = 4087, 4089

SHIPPED = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
]


def tokenizer_config() -> dict:
    tok = json.loads((HERE / "data" / "tokenizer.json").read_text())
    added = {
        str(t["id"]): {
            k: t[k] for k in ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
        }
        for t in tok["added_tokens"]
    }
    return {
        "tokenizer_class": "TokenizersBackend",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 4096,
        "split_special_tokens": False,
        "added_tokens_decoder": added,
    }


def generation_config() -> dict:
    """Sampling defaults that keep a model this small out of loops. Measured with measure.py
    (5 prompts x 4 seeds, 200 tokens each, lily's 64-token penalty window): on the first demo,
    Qwen's non-thinking defaults alone (T 0.7, top-p 0.8, top-k 20) repeat 18% of 4-grams, with
    loops up to 132 tokens ("cafile cafile ..."). On the second demo the same defaults with a
    repetition penalty of 1.2 still repeat 10.3% and loop for up to 87 tokens (docstring
    layouts: "Returns: ... ndarray" again and again); 1.3 brings that to 5.0% and 20 tokens.
    max_new_tokens 128: a short answer by default. The penalty applies to greedy decoding too
    (transformers' semantics): pass repetition_penalty=1 for plain argmax."""
    return {
        "bos_token_id": None,
        "eos_token_id": [IM_END_ID, EOT_ID],
        "pad_token_id": EOT_ID,
        "do_sample": True,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.3,
        "max_new_tokens": 128,
    }


def write_side_files(dst: Path) -> None:
    shutil.copy(HERE / "data" / "tokenizer.json", dst / "tokenizer.json")
    shutil.copy(HERE / "assets" / "chat_template.jinja", dst / "chat_template.jinja")
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (dst / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")


def random_twin(hf: Path, dst: Path, seed: int = 1234) -> None:
    """The same config with transformers' own random initialization (the perplexity baseline)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from train import export

    cfg = json.loads((hf / "config.json").read_text())["text_config"]
    tcfg = {
        k: v
        for k, v in cfg.items()
        if k not in ("model_type", "layer_types", "dtype", "decoder_sparse_step", "norm_topk_prob")
    }
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**tcfg))
    export(model, tcfg, dst)


def convert(hf: Path, out: Path) -> None:
    from mlx_lm import convert as mlx_convert

    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "hf"
        stage.mkdir()
        for f in hf.iterdir():
            if f.suffix in (".json", ".safetensors") and f.name not in ("train_summary.json",):
                shutil.copy(f, stage / f.name)
        write_side_files(stage)
        mlx_out = Path(tmp) / "mlx"
        mlx_convert(
            str(stage), str(mlx_out), quantize=True, q_group_size=64, q_bits=4, dtype="bfloat16"
        )
        out.mkdir(parents=True, exist_ok=True)
        for name in SHIPPED:
            src = mlx_out / name
            if name == "model.safetensors" and not src.exists():
                raise SystemExit(
                    f"mlx_lm.convert wrote no single {name}: {sorted(mlx_out.iterdir())}"
                )
            if src.exists():
                shutil.copy(src, out / name)
        write_side_files(out)
    total = sum((out / n).stat().st_size for n in SHIPPED)
    print(f"wrote {out}: {total / 1e6:.2f} MB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, help="checkpoint folder written by train.py")
    ap.add_argument("--out", default=str(REPO / "src" / "lily" / "demo"))
    ap.add_argument(
        "--random-twin",
        action="store_true",
        help="convert a randomly initialized model of the same config instead",
    )
    args = ap.parse_args()
    hf = Path(args.hf)
    if args.random_twin:
        with tempfile.TemporaryDirectory() as tmp:
            random_twin(hf, Path(tmp))
            convert(Path(tmp), Path(args.out))
    else:
        convert(hf, Path(args.out))


if __name__ == "__main__":
    main()
