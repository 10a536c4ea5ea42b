"""Measure the demo model: held-out perplexity (trained vs random twins) and sample generations.

References only (nothing of lily): transformers on the bf16/fp32 HF checkpoint from train.py and
mlx-lm on the shipped 4-bit folder. Three baselines of the same shapes:
  * "random init": transformers' own initialization of the same config (fp32; and its mlx-lm 4-bit
    conversion, made by `convert.py --random-twin`),
  * "shuffled": every tensor of the shipped 4-bit file with its elements permuted (what
    tests/test_demo_model.py builds for lily, since it needs no converter).
Texts: the validation token stream (val.bin, documents never trained on) in 512-token windows, and
tests/data/demo_heldout.txt (held-out prose paragraphs separated by blank lines, each scored from a
fresh state).

  python evaluate.py --hf /tmp/ckpt --mlx ../../src/lily/demo --twin-mlx /tmp/twin --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))


def nll(logits: np.ndarray, ids: np.ndarray) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of ids[1:] given logits[:-1] (float64 softmax)."""
    lg = logits[:-1].astype(np.float64)
    lg -= lg.max(-1, keepdims=True)
    logp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].sum()), len(ids) - 1


def perplexity(logits_fn, seqs: list[np.ndarray]) -> float:
    total, count = 0.0, 0
    for s in seqs:
        a, b = nll(logits_fn(s), s)
        total, count = total + a, count + b
    return float(np.exp(total / count))


def hf_model(ckpt: Path | None, like: Path):
    import torch
    from safetensors.torch import load_file
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = json.loads((like / "config.json").read_text())["text_config"]
    tcfg = {
        k: v
        for k, v in cfg.items()
        if k not in ("model_type", "layer_types", "dtype", "decoder_sparse_step", "norm_topk_prob")
    }
    torch.manual_seed(1234)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**tcfg)).float().eval()
    if ckpt is not None:
        state = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            for k, v in load_file(str(f)).items():
                state[k.replace("model.language_model.", "model.")] = v.float()
        model.load_state_dict(state, strict=True)
    torch.set_num_threads(2)

    def logits(ids: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return (
                model(input_ids=torch.from_numpy(ids.astype(np.int64))[None])
                .logits[0]
                .float()
                .numpy()
            )

    return logits


def mlx_model(path: Path):
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(path))
    # Upcast the stored bf16 scales/biases/norms to fp32 (exact): mlx then computes in fp32 on the
    # same quantized values, which on Linux CPUs is also ~8x faster than its bf16 path.
    from mlx.utils import tree_map

    model.update(
        tree_map(
            lambda x: x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, model.parameters()
        )
    )

    def logits(ids: np.ndarray) -> np.ndarray:
        out = model(mx.array(ids.astype(np.int32))[None])
        return np.array(out[0].astype(mx.float32))

    return logits, model, tok


def shuffled_copy(src: Path, dst: Path, seed: int = 0) -> None:
    """Same files, every tensor's elements permuted (raw units: bf16 as uint16, u32/f32 as uint32)."""
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    raw = (src / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    body = bytearray(raw[8 + n :])
    rng = np.random.default_rng(seed)
    unit = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32, "U32": np.uint32}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        view = np.frombuffer(
            body,
            dtype=unit[t["dtype"]],
            count=(b - a) // np.dtype(unit[t["dtype"]]).itemsize,
            offset=a,
        )
        body[a:b] = rng.permutation(view).tobytes()
    (dst / "model.safetensors").write_bytes(raw[: 8 + n] + bytes(body))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hf", required=True, help="trained checkpoint from train.py")
    ap.add_argument("--mlx", default=str(REPO / "src" / "lily" / "demo"))
    ap.add_argument("--twin-mlx", required=True, help="convert.py --random-twin output")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hf, mlx_dir, twin_dir = Path(args.hf), Path(args.mlx), Path(args.twin_mlx)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(mlx_dir / "tokenizer.json"))
    val = np.fromfile(HERE / "data" / "val.bin", dtype=np.uint16).astype(np.int64)
    starts = np.linspace(0, val.size - 513, args.windows).astype(np.int64)
    windows = [val[s : s + 512] for s in starts]
    heldout = [
        np.array(tok.encode(para.strip()).ids)
        for para in (REPO / "tests" / "data" / "demo_heldout.txt").read_text().split("\n\n")
        if para.strip()
    ]

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        shuffled_copy(mlx_dir, Path(tmp) / "shuffled")
        models = {
            "trained, transformers (bf16 weights, fp32 compute)": hf_model(hf, hf),
            "random init, transformers (fp32)": hf_model(None, hf),
            "trained, mlx-lm 4-bit (shipped file, fp32 compute)": mlx_model(mlx_dir)[0],
            "random init, mlx-lm 4-bit (fp32 compute)": mlx_model(twin_dir)[0],
            "shuffled 4-bit (the test's twin), mlx-lm": mlx_model(Path(tmp) / "shuffled")[0],
        }
        for name, fn in models.items():
            results[name] = {
                f"val.bin ({len(windows)} x 512 tokens)": round(perplexity(fn, windows), 2),
                "tests/data/demo_heldout.txt": round(perplexity(fn, heldout), 2),
            }
            print(name, results[name], flush=True)

    # Samples from the shipped 4-bit model through mlx-lm.
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    _, model, mtok = mlx_model(mlx_dir)
    prompts = [
        "The json module",
        "A list comprehension is",
        "To open a file for reading,",
        "Love is",
        "The difference between a tuple and a list is",
    ]
    samples = []
    for p in prompts:
        g = generate(model, mtok, p, max_tokens=48, verbose=False)
        s = generate(
            model,
            mtok,
            p,
            max_tokens=48,
            verbose=False,
            sampler=make_sampler(temp=0.7, top_p=0.8, top_k=20),
        )
        samples.append({"prompt": p, "greedy": g, "sampled (t=0.7, p=0.8, k=20)": s})
    for q in ["What does os.path.join do?", "Tell me a fortune."]:
        prompt = mtok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        g = generate(model, mtok, prompt, max_tokens=64, verbose=False)
        samples.append({"chat": q, "greedy": g})
    for s in samples:
        print(json.dumps(s), flush=True)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"perplexity": results, "samples": samples}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
