"""A random-weight GGUF of Qwen3.6-35B-A3B for llama.cpp (arch `qwen35moe`), same shapes as the
checkpoint scripts/make_fullsize.py writes, so llama.cpp can be timed next to lily at full size.

Design choices:

- The metadata comes from a template: a GGUF that llama.cpp's own `convert_hf_to_gguf.py`
  wrote for a tiny Qwen3.5-MoE checkpoint carrying the real Qwen3.5/3.6 tokenizer (its keys,
  tokenizer arrays, pre-tokenizer `qwen35`). `--strip` keeps only that metadata (no tensors);
  the writer copies it and overwrites every size-dependent key with the full-size value. The
  tensor names, ggml shapes (ne0 first) and types are those of the converter's output followed
  by `llama-quantize --pure Q4_0`: every matrix Q4_0 (4.5 bits per weight, the same as MLX
  4-bit group 64 with bf16 scale and bias), norms / ssm_a / ssm_dt / ssm_conv1d / the router
  `ffn_gate_inp` / the 1-column shared-expert gate in F32, as llama-quantize leaves them.
- Values: Q4_0 blocks have random nibbles and a random-SIGN f16 scale in [2^-9, 2^-8): Q4_0's
  (q - 8) has mean -1/2, and a scale of one sign would put a common direction into every matrix
  and collapse the MoE routing (see docs/performance.md); random signs cancel it.
- Written like make_fullsize: header first, then worker processes fill <= 64 MB pieces with
  os.pwrite at offsets computed with GGUF's 32-byte tensor alignment.

    python benchmarks/fullsize/make_gguf.py --strip CONVERTED_TINY.gguf TEMPLATE.gguf
    python benchmarks/fullsize/make_gguf.py TEMPLATE.gguf OUT.gguf [--layers N --experts E]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import make_fullsize as mf  # noqa: E402

ALIGN = 32
Q4_0_BLOCK = (32, 18)  # weights, bytes: f16 scale + 16 bytes of nibbles


def _gguf():
    import gguf  # from llama.cpp's gguf-py (PYTHONPATH) or the PyPI package

    return gguf


def tensors(tc: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape ne0-first, 'Q4_0' | 'F32') in the converter's order."""
    H, V, E = tc["hidden_size"], tc["vocab_size"], tc["num_experts"]
    I, Is = tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]  # noqa: E741
    Nq, Nkv, Dh = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    Nk, Nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    Dk, Dv, K = tc["linear_key_head_dim"], tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"]
    C = 2 * Nk * Dk + Nv * Dv
    q, f = "Q4_0", "F32"
    out = [("output.weight", (H, V), q), ("token_embd.weight", (H, V), q)]
    for i, kind in enumerate(tc["layer_types"]):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (H,), f))
        if kind == "linear_attention":
            out += [
                (b + "ssm_a", (Nv,), f),
                (b + "ssm_conv1d.weight", (K, C), f),
                (b + "ssm_dt.bias", (Nv,), f),
                (b + "ssm_alpha.weight", (H, Nv), q),
                (b + "ssm_beta.weight", (H, Nv), q),
                (b + "attn_qkv.weight", (H, C), q),
                (b + "attn_gate.weight", (H, Nv * Dv), q),
                (b + "ssm_norm.weight", (Dv,), f),
                (b + "ssm_out.weight", (Nv * Dv, H), q),
            ]
        out += [
            (b + "ffn_down_exps.weight", (I, H, E), q),
            (b + "ffn_gate_exps.weight", (H, I, E), q),
            (b + "ffn_up_exps.weight", (H, I, E), q),
            (b + "ffn_gate_inp.weight", (H, E), f),
            (b + "ffn_down_shexp.weight", (Is, H), q),
            (b + "ffn_gate_shexp.weight", (H, Is), q),
            (b + "ffn_up_shexp.weight", (H, Is), q),
            (b + "ffn_gate_inp_shexp.weight", (H, 1), f),
            (b + "post_attention_norm.weight", (H,), f),
        ]
        if kind == "full_attention":
            out += [
                (b + "attn_k_norm.weight", (Dh,), f),
                (b + "attn_k.weight", (H, Nkv * Dh), q),
                (b + "attn_output.weight", (Nq * Dh, H), q),
                (b + "attn_q_norm.weight", (Dh,), f),
                (b + "attn_q.weight", (H, Nq * 2 * Dh), q),
                (b + "attn_v.weight", (H, Nkv * Dh), q),
            ]
    out.append(("output_norm.weight", (H,), f))
    return out


def nbytes(shape: tuple[int, ...], kind: str) -> int:
    n = int(np.prod(shape))
    return n // Q4_0_BLOCK[0] * Q4_0_BLOCK[1] if kind == "Q4_0" else 4 * n


def hparams(tc: dict) -> dict:
    """The size-dependent qwen35moe keys (names as convert_hf_to_gguf writes them)."""
    a = "qwen35moe."
    rot = int(tc["head_dim"] * tc["rope_parameters"]["partial_rotary_factor"])
    return {
        a + "block_count": ("u32", tc["num_hidden_layers"]),
        a + "context_length": ("u32", tc["max_position_embeddings"]),
        a + "embedding_length": ("u32", tc["hidden_size"]),
        a + "attention.head_count": ("u32", tc["num_attention_heads"]),
        a + "attention.head_count_kv": ("u32", tc["num_key_value_heads"]),
        a + "attention.key_length": ("u32", tc["head_dim"]),
        a + "attention.value_length": ("u32", tc["head_dim"]),
        a + "rope.dimension_count": ("u32", rot),
        a + "rope.dimension_sections": ("arr_i32", [*tc["rope_parameters"]["mrope_section"], 0]),
        a + "rope.freq_base": ("f32", tc["rope_parameters"]["rope_theta"]),
        a + "attention.layer_norm_rms_epsilon": ("f32", tc["rms_norm_eps"]),
        a + "expert_count": ("u32", tc["num_experts"]),
        a + "expert_used_count": ("u32", tc["num_experts_per_tok"]),
        a + "expert_feed_forward_length": ("u32", tc["moe_intermediate_size"]),
        a + "expert_shared_feed_forward_length": ("u32", tc["shared_expert_intermediate_size"]),
        a + "ssm.conv_kernel": ("u32", tc["linear_conv_kernel_dim"]),
        a + "ssm.state_size": ("u32", tc["linear_key_head_dim"]),
        a + "ssm.group_count": ("u32", tc["linear_num_key_heads"]),
        a + "ssm.time_step_rank": ("u32", tc["linear_num_value_heads"]),
        a + "ssm.inner_size": ("u32", tc["linear_num_value_heads"] * tc["linear_value_head_dim"]),
        a + "attention.recurrent_layers": ("arr_bool", [t == "linear_attention" for t in tc["layer_types"]]),
        a + "full_attention_interval": ("u32", tc["full_attention_interval"]),
        "general.file_type": ("u32", 2),  # LLAMA_FTYPE_MOSTLY_Q4_0
        "general.name": ("str", "Qwen3.6-35B-A3B random"),
    }


def _copy_kv(reader, writer, skip: set[str]) -> None:
    gguf = _gguf()
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in skip or name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, field.contents(), vtype)


def strip(src: Path, dst: Path) -> None:
    """The metadata of a converted GGUF, no tensors."""
    gguf = _gguf()
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    _copy_kv(r, w, set())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()


def _fill(kind: str, count: int, seed: int, what: str) -> bytes:
    rng = np.random.default_rng(seed)
    if kind == "Q4_0":
        blocks = count // 32
        raw = mf._random_u64((blocks * 18 + 7) // 8, rng).view(np.uint8)[: blocks * 18].reshape(blocks, 18)
        d = raw[:, :2].copy().view(np.uint16)[:, 0]
        # f16 scale: random sign, exponent of 2^-9 (field 6), random mantissa.
        raw[:, :2] = ((d & np.uint16(0x83FF)) | np.uint16(6 << 10)).view(np.uint8).reshape(blocks, 2)
        return raw.tobytes()
    if what.endswith("norm.weight"):
        v = 1.0 + 0.1 * rng.standard_normal(count)
    elif what.endswith("ssm_a"):
        v = -rng.uniform(1.0, 16.0, count)  # -exp(A_log)
    elif what.endswith("ssm_dt.bias"):
        v = 1.0 + 0.5 * rng.standard_normal(count)
    elif "conv1d" in what:
        v = 0.3 * rng.standard_normal(count)
    else:  # router and shared-expert gate: like 8-bit MLX weights, std ~ 0.03
        v = 0.03 * rng.standard_normal(count)
    return v.astype(np.float32).tobytes()


_FD: dict[str, int] = {}


def _write(job) -> int:
    path, off, kind, count, seed, what = job
    fd = _FD.get(path)
    if fd is None:
        fd = _FD[path] = os.open(path, os.O_WRONLY)
    data = _fill(kind, count, seed, what)
    os.pwrite(fd, data, off)
    return len(data)


def write(template: Path, out: Path, tc: dict, workers: int = 0, log=print) -> dict:
    gguf = _gguf()
    t0 = time.perf_counter()
    r = gguf.GGUFReader(str(template))
    arch = r.fields["general.architecture"].contents()
    if arch != "qwen35moe":
        raise SystemExit(f"[make_gguf] template {template} is {arch!r}, expected qwen35moe")
    hp = hparams(tc)
    w = gguf.GGUFWriter(str(out), arch)
    _copy_kv(r, w, set(hp) | {"general.size_label"})
    V = gguf.GGUFValueType
    types = {"u32": V.UINT32, "f32": V.FLOAT32, "str": V.STRING}
    for k, (t, v) in hp.items():
        if t == "arr_i32":
            w.add_key_value(k, v, V.ARRAY, sub_type=V.INT32)
        elif t == "arr_bool":
            w.add_key_value(k, v, V.ARRAY, sub_type=V.BOOL)
        else:
            w.add_key_value(k, v, types[t])
    specs = tensors(tc)
    qt = {"Q4_0": gguf.GGMLQuantizationType.Q4_0, "F32": gguf.GGMLQuantizationType.F32}
    for name, shape, kind in specs:
        # add_tensor_info takes the numpy (row-major) shape, ggml's ne reversed; for a quantized
        # type, in bytes along the last axis.
        np_shape = list(reversed(shape))
        if kind == "Q4_0":
            np_shape[-1] = np_shape[-1] // Q4_0_BLOCK[0] * Q4_0_BLOCK[1]
        dtype = np.dtype(np.uint8 if kind == "Q4_0" else np.float32)
        w.add_tensor_info(name, tuple(np_shape), dtype, nbytes(shape, kind), raw_dtype=qt[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    start = os.path.getsize(out)
    start += -start % ALIGN
    jobs, off = [], start
    for i, (name, shape, kind) in enumerate(specs):
        n = int(np.prod(shape))
        per = (mf.PIECE_BYTES // 18) * 32 if kind == "Q4_0" else mf.PIECE_BYTES // 4
        for s in range(0, n, per):
            m = min(per, n - s)
            jobs.append((str(out), off + nbytes((s,), kind), kind, m, (i << 20) + s // per, name))
        off += nbytes(shape, kind)
        off += -off % ALIGN
    with open(out, "r+b") as f:
        f.truncate(off)
    jobs.sort(key=lambda j: -j[3])
    done = 0
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        done = sum(_write(j) for j in jobs)
    else:
        with mp.get_context("fork").Pool(workers) as pool:
            done = sum(pool.imap_unordered(_write, jobs, chunksize=1))
    secs = time.perf_counter() - t0
    log(f"[make_gguf] {off / 1e9:.2f} GB ({len(specs)} tensors) -> {out} in {secs:.1f} s")
    return {"bytes": off, "seconds": secs, "data": done}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("template", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--strip", action="store_true", help="write TEMPLATE's metadata only to OUT")
    ap.add_argument("--layers", type=int, default=mf.FULL["layers"])
    ap.add_argument("--experts", type=int, default=mf.FULL["experts"])
    ap.add_argument("--workers", type=int, default=0)
    a = ap.parse_args(argv)
    if a.strip:
        strip(a.template, a.out)
        return
    write(a.template, a.out, mf.text_config(a.layers, a.experts, mf.FULL["vocab"]), a.workers)


if __name__ == "__main__":
    main()
