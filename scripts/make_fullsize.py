"""Write a Qwen3.6-35B-A3B checkpoint with random weights in the exact layout of the published
MLX 4-bit release (`mlx-community/Qwen3.6-35B-A3B-4bit`): same tensor names, shapes, dtypes,
quantization (4-bit group 64; the router `mlp.gate` and `mlp.shared_expert_gate` 8-bit group 64,
listed as per-path overrides in config.json `quantization`), ~5 GB safetensors shards with
`model.safetensors.index.json`, and the composite `qwen3_5_moe` config.json with `text_config`.

Speed and memory of an inference engine depend only on shapes and formats, so this stands in for
the real 19.4 GB download on machines that cannot reach a model hub.

Design choices:

- Nothing is held in memory: the layout (every shard's header and each tensor's byte range) is
  computed first, the shard files are created at their final size, and worker processes fill
  disjoint <= 64 MB pieces with `os.pwrite`. Peak memory is a few pieces per worker.
- Random bytes are cheap, not cryptographic: numpy's generators give well under 1 GB/s per core,
  so each worker draws one 32 MB random block once and every piece is that block, at a random
  offset, XOR-ed with a random 64-bit key. The quantized codes are uniformly spread; their
  repetition at 32 MB periods changes no engine's speed.
- Values keep a 40-layer random forward finite and the routing spread like a trained model's:
  scales s in [2^-9, 2^-8) (4-bit) or [2^-12, 2^-11) (8-bit) written as bf16 bit patterns,
  biases bf16(-(2^bits - 1)/2 * s) from the same random mantissa, so w = s*(q - 7.5) has zero
  mean (a biased mean collapses the router onto one expert); norms near 1 (MLX stores 1 + w),
  conv1d small, A_log = log of [1, 16), dt_bias near 1.
- `--layers/--experts/--vocab` shrink the model for a CI smoke run while every per-layer matrix
  keeps its real size; `spec()` gives the full-size names/shapes/dtypes without writing anything.

    python scripts/make_fullsize.py OUT_DIR [--workers 16] [--tokenizer DIR]
    python scripts/make_fullsize.py OUT_DIR --layers 4 --experts 8 --vocab 4096   # smoke size
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# -- the model -------------------------------------------------------------------------------

FULL = dict(layers=40, experts=256, vocab=248_320)
BITS, GROUP = 4, 64  # default quantization of the release
ROUTER_BITS = 8  # mlp.gate and mlp.shared_expert_gate (mlx-lm's qwen3_5 quant_predicate)
SHARD_BYTES = 5 << 30  # mlx-lm's make_shards: 5 GB
PIECE_BYTES = 64 << 20
PREFIX = "language_model.model."
EOS = [248046, 248044]  # <|im_end|>, <|endoftext|>


def text_config(layers: int = 40, experts: int = 256, vocab: int = 248_320) -> dict:
    """text_config of Qwen3.6-35B-A3B (as the release's config.json), resizable for smoke runs."""
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab,
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_act": "silu",
        "max_position_embeddings": 262_144,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_parameters": {
            "type": "default",  # mlx-lm re-saves rope_type as type
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": experts,
        "num_experts_per_tok": min(8, experts),
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "full_attention_interval": 4,
        "layer_types": layer_types,
        "bos_token_id": None,
        "eos_token_id": EOS[1],
        "pad_token_id": EOS[1],
        "dtype": "bfloat16",
    }


def quantization(tc: dict) -> dict:
    q: dict = {"group_size": GROUP, "bits": BITS, "mode": "affine"}
    for i in range(tc["num_hidden_layers"]):
        for m in ("mlp.gate", "mlp.shared_expert_gate"):
            q[f"{PREFIX}layers.{i}.{m}"] = {"group_size": GROUP, "bits": ROUTER_BITS}
    return q


def config_json(tc: dict) -> dict:
    q = quantization(tc)
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": tc,
        "tie_word_embeddings": False,
        "eos_token_id": EOS,
        "pad_token_id": EOS[1],
        "quantization": q,
        "quantization_config": q,  # mlx-lm writes both
    }


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # safetensors dtype: U32 | BF16 | F32
    shape: tuple[int, ...]
    kind: str  # how its bytes are made: see _fill
    bits: int = 0  # for quantized parts

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * (4 if self.dtype in ("U32", "F32") else 2)


def _quantized(name: str, rows: tuple[int, ...], cols: int, bits: int) -> list[Tensor]:
    """MLX affine quantized Linear [*rows, cols]: weight U32 [*rows, cols*bits/32], bf16 scales and
    biases [*rows, cols/GROUP]."""
    return [
        Tensor(f"{name}.weight", "U32", (*rows, cols * bits // 32), "codes", bits),
        Tensor(f"{name}.scales", "BF16", (*rows, cols // GROUP), "scales", bits),
        Tensor(f"{name}.biases", "BF16", (*rows, cols // GROUP), "biases", bits),
    ]


def spec(tc: dict) -> list[Tensor]:
    """Every tensor of the checkpoint, sorted by name (the order mlx writes them)."""
    H, V, E = tc["hidden_size"], tc["vocab_size"], tc["num_experts"]
    I, Is = tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]  # noqa: E741
    Nq, Nkv, Dh = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    Nk, Nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    Dk, Dv, K = tc["linear_key_head_dim"], tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"]
    C = 2 * Nk * Dk + Nv * Dv  # conv channels q|k|v
    out = _quantized("language_model.lm_head", (V,), H, BITS)
    out += _quantized(PREFIX + "embed_tokens", (V,), H, BITS)
    out.append(Tensor(PREFIX + "norm.weight", "BF16", (H,), "norm"))
    for i, kind in enumerate(tc["layer_types"]):
        p = f"{PREFIX}layers.{i}."
        out.append(Tensor(p + "input_layernorm.weight", "BF16", (H,), "norm"))
        out.append(Tensor(p + "post_attention_layernorm.weight", "BF16", (H,), "norm"))
        if kind == "linear_attention":
            a = p + "linear_attn."
            out += _quantized(a + "in_proj_qkv", (C,), H, BITS)
            out += _quantized(a + "in_proj_z", (Nv * Dv,), H, BITS)
            out += _quantized(a + "in_proj_b", (Nv,), H, BITS)
            out += _quantized(a + "in_proj_a", (Nv,), H, BITS)
            out += _quantized(a + "out_proj", (H,), Nv * Dv, BITS)
            out.append(Tensor(a + "conv1d.weight", "BF16", (C, K, 1), "conv"))  # MLX [C, K, 1]
            out.append(Tensor(a + "dt_bias", "BF16", (Nv,), "dt_bias"))
            out.append(Tensor(a + "A_log", "F32", (Nv,), "A_log"))  # fp32 in the release
            out.append(Tensor(a + "norm.weight", "BF16", (Dv,), "norm"))
        else:
            a = p + "self_attn."
            out += _quantized(a + "q_proj", (Nq * 2 * Dh,), H, BITS)  # per head: query | gate
            out += _quantized(a + "k_proj", (Nkv * Dh,), H, BITS)
            out += _quantized(a + "v_proj", (Nkv * Dh,), H, BITS)
            out += _quantized(a + "o_proj", (H,), Nq * Dh, BITS)
            out.append(Tensor(a + "q_norm.weight", "BF16", (Dh,), "norm"))
            out.append(Tensor(a + "k_norm.weight", "BF16", (Dh,), "norm"))
        m = p + "mlp."
        out += _quantized(m + "gate", (E,), H, ROUTER_BITS)
        out += _quantized(m + "shared_expert_gate", (1,), H, ROUTER_BITS)
        out += _quantized(m + "shared_expert.gate_proj", (Is,), H, BITS)
        out += _quantized(m + "shared_expert.up_proj", (Is,), H, BITS)
        out += _quantized(m + "shared_expert.down_proj", (H,), Is, BITS)
        out += _quantized(m + "switch_mlp.gate_proj", (E, I), H, BITS)
        out += _quantized(m + "switch_mlp.up_proj", (E, I), H, BITS)
        out += _quantized(m + "switch_mlp.down_proj", (E, H), I, BITS)
    return sorted(out, key=lambda t: t.name)


# -- layout ----------------------------------------------------------------------------------


def _header(tensors: list[Tensor]) -> bytes:
    meta: dict = {"__metadata__": {"format": "mlx"}}
    off = 0
    for t in tensors:
        meta[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def shards(tensors: list[Tensor]) -> list[list[Tensor]]:
    """mlx-lm's make_shards: fill a shard until the next tensor would pass SHARD_BYTES."""
    out: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if out[-1] and size + t.nbytes > SHARD_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.nbytes
    return out


def shard_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


# -- bytes -----------------------------------------------------------------------------------

_BLOCK: np.ndarray | None = None  # the random block (uint64), the same in every worker


def _random_u64(n: int, rng: np.random.Generator) -> np.ndarray:
    global _BLOCK
    if _BLOCK is None:
        # random_raw: all 64 bits random (integers(0, 2**63) would leave every 16th 4-bit code
        # below 8, a common direction in every weight matrix).
        _BLOCK = np.random.default_rng(12345).bit_generator.random_raw((32 << 20) // 8)
        _BLOCK = np.concatenate([_BLOCK, _BLOCK])  # so any offset has a full block after it
    out = np.empty(n, np.uint64)
    half = _BLOCK.size // 2
    for s in range(0, n, half):
        m = min(half, n - s)
        off = int(rng.integers(0, half))
        np.bitwise_xor(_BLOCK[off : off + m], np.uint64(rng.bit_generator.random_raw()), out=out[s : s + m])
    return out


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (round to nearest even)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def _fill(kind: str, bits: int, count: int, seed: int) -> bytes:
    """`count` elements of a tensor of this kind. scales and biases of one Linear use the same
    seed per piece, so bias = -(2^bits - 1)/2 * scale element by element (to bf16)."""
    rng = np.random.default_rng(seed)
    if kind == "codes":
        return _random_u64((count + 1) // 2, rng).view(np.uint32)[:count].tobytes()
    if kind in ("scales", "biases"):
        mant = _random_u64((count + 3) // 4, rng).view(np.uint16)[:count] & np.uint16(0x7F)
        lo = 127 - (9 if bits == 4 else 12)  # exponent of s: [2^-9, 2^-8) or [2^-12, 2^-11)
        scales = mant | np.uint16(lo << 7)
        if kind == "scales":
            return scales.tobytes()
        # Centred codes: w = s * (q - (2^bits - 1) / 2). An offset of -2^(bits-1) would give every
        # weight a mean of -s/2, a common direction in every projection that makes all tokens
        # pick the same experts (measured: 1 expert of 256 for every token) -- an MoE unlike
        # a trained one, whose prefill touches every expert.
        s32 = (scales.astype(np.uint32) << 16).view(np.float32)
        return _bf16(s32 * np.float32(-(2 ** bits - 1) / 2)).tobytes()
    if kind == "norm":
        return _bf16(1.0 + 0.1 * rng.standard_normal(count)).tobytes()
    if kind == "conv":
        return _bf16(0.3 * rng.standard_normal(count)).tobytes()
    if kind == "dt_bias":
        return _bf16(1.0 + 0.5 * rng.standard_normal(count)).tobytes()
    if kind == "A_log":
        return np.log(rng.uniform(1.0, 16.0, count)).astype(np.float32).tobytes()
    raise ValueError(kind)


@dataclass(frozen=True)
class Piece:
    path: str
    offset: int  # byte offset in the file
    kind: str
    bits: int
    count: int  # elements
    seed: int


def _pieces(t: Tensor, path: str, offset: int, seed: int) -> list[Piece]:
    esize = t.nbytes // int(np.prod(t.shape))
    per = max(1, PIECE_BYTES // esize)
    n = int(np.prod(t.shape))
    # scales and biases share the seed of their Linear so their mantissas match.
    base = t.name.rsplit(".", 1)[0] if t.kind in ("scales", "biases") else t.name
    key = zlib.crc32(base.encode()) ^ (seed << 32)
    return [Piece(path, offset + s * esize, t.kind, t.bits, min(per, n - s), key + s) for s in range(0, n, per)]


_FDS: dict[str, int] = {}


def _write(p: Piece) -> int:
    fd = _FDS.get(p.path)
    if fd is None:
        fd = _FDS[p.path] = os.open(p.path, os.O_WRONLY)
    data = _fill(p.kind, p.bits, p.count, p.seed)
    os.pwrite(fd, data, p.offset)
    return len(data)


def write(out: Path, tc: dict, workers: int = 0, seed: int = 0, tokenizer: Path | None = None,
          log=print) -> dict:
    """Writes the checkpoint into `out`; returns {"bytes", "seconds", "shards"}."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    groups = shards(spec(tc))
    names = shard_names(len(groups))
    pieces: list[Piece] = []
    weight_map, total = {}, 0
    for name, group in zip(names, groups, strict=True):
        head = _header(group)
        size = len(head) + sum(t.nbytes for t in group)
        path = out / name
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(size)
        off = len(head)
        for t in group:
            pieces += _pieces(t, str(path), off, seed)
            weight_map[t.name] = name
            off += t.nbytes
            total += t.nbytes
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (out / "config.json").write_text(json.dumps(config_json(tc), indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": EOS[1], "eos_token_id": EOS, "pad_token_id": EOS[1], "do_sample": True,
                    "temperature": 1.0, "top_k": 20, "top_p": 0.95}, indent=2)
    )
    if tokenizer is not None:
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer / f).is_file():
                shutil.copy(tokenizer / f, out / f)
    workers = workers or os.cpu_count() or 1
    done = 0
    # Largest pieces first keeps the workers busy to the end.
    pieces.sort(key=lambda p: -p.count)
    if workers == 1:
        for p in pieces:
            done += _write(p)
    else:
        with mp.get_context("fork").Pool(workers) as pool:
            for n in pool.imap_unordered(_write, pieces, chunksize=1):
                done += n
    secs = time.perf_counter() - t0
    log(f"[make_fullsize] {total / 1e9:.2f} GB in {len(names)} shard(s) -> {out} in {secs:.1f} s "
        f"({total / 1e9 / secs:.2f} GB/s, {workers} workers)")
    return {"bytes": total, "seconds": secs, "shards": len(names)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=FULL["layers"])
    ap.add_argument("--experts", type=int, default=FULL["experts"])
    ap.add_argument("--vocab", type=int, default=FULL["vocab"])
    ap.add_argument("--workers", type=int, default=0, help="processes (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (scripts/make_tokenizer.py)")
    ap.add_argument("--dry-run", action="store_true", help="print the layout, write nothing")
    a = ap.parse_args(argv)
    if a.layers < 1 or a.experts < 1 or a.vocab < 1:
        ap.error("--layers, --experts and --vocab must be positive")
    tc = text_config(a.layers, a.experts, a.vocab)
    if a.dry_run:
        groups = shards(spec(tc))
        for name, g in zip(shard_names(len(groups)), groups, strict=True):
            print(f"{name}: {len(g)} tensors, {sum(t.nbytes for t in g) / 1e9:.3f} GB")
        print(f"total {sum(t.nbytes for g in groups for t in g) / 1e9:.3f} GB")
        return
    write(a.out, tc, a.workers, a.seed, a.tokenizer)


if __name__ == "__main__":
    sys.exit(main())
