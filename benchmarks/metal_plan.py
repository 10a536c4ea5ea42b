#!/usr/bin/env python3
"""Plan report of the Metal backend's decode step at the real Qwen3.6-35B-A3B shape.

Counted from the dispatch sequence, not executed: lily._core.gpu_plan runs GpuBackend (the
same host code that drives Metal and the MSL-on-CPU runtime) over a recording gpu::Device whose
buffers have sizes but no memory, with synthetic weights of the sizes a 4-bit MLX checkpoint
has (group 64, bf16 scales and biases, router and shared-expert gate 8-bit). For each context:

- kernels (dispatches) and dependency stages (memory-barrier-separated groups of a concurrent
  encoder) per decode step, command buffers and CPU waits per token;
- bytes each dispatch declares it reads: weights (active experts only), state (KV cache rows
  up to the context, DeltaNet state read and written back, conv windows) and activations;
- against the minimum a decode step must move, computed here from the config alone: dense
  weights + the top-k experts of each MoE layer + the lm_head + one embedding row + KV
  (as stored: f32) + DeltaNet/conv state read and written once.

Prefill (--prompts, default 512 4096 32768; --chunk, default 512): lily._core.gpu_plan_prefill
encodes the whole prompt in chunks the way Engine.generate_greedy runs it (every chunk but the
last as a prefill pass, the last as device greedy step 0 whose argmax stays on the device) and
reports, per prompt: chunks, dispatches and stages of a chunk, CPU waits inside chunks (goal 0)
and in all, unique checkpoint bytes a chunk's dispatches declare (against the minimum: dense
weights + every expert a chunk of that size can touch, min(T*k, E) per layer), KV bytes the
attention dispatches read, and the device memory the backend holds besides the weights
(sequence state, and scratch: activations for one chunk, tables).

    PYTHONPATH=src python benchmarks/metal_plan.py [--contexts 4096 32768 131072] [--prompts 512 4096 32768]
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict

from lily import _core

# Qwen3.6-35B-A3B (see ../shared/REFERENCE.md): 40 layers, attention every 4th.
LAYERS = 40
BITS, GROUP, GATE_BITS = 4, 64, 8


def config_35b() -> _core.ModelConfig:
    c = _core.ModelConfig()
    c.model_type = "qwen3_5_moe"
    c.hidden, c.vocab, c.max_position, c.rms_eps = 2048, 248320, 262144, 1e-6
    c.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)]
    c.ffn_types = ["moe"] * LAYERS
    c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim, c.rope_theta = 16, 2, 256, 64, 1e7
    c.gdn_k_heads, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim, c.conv_kernel = 16, 32, 128, 128, 4
    c.n_experts, c.top_k, c.moe_intermediate, c.shared_intermediate = 256, 8, 512, 512
    c.intermediate, c.norm_topk_prob = 0, True
    c.validate()
    return c


def qbytes(out: int, inp: int, bits: int = BITS) -> int:
    """Bytes of an MLX affine matrix: packed weights + bf16 scales and biases."""
    return out * inp * bits // 8 + 2 * 2 * out * (inp // GROUP)


def minimum_bytes(c: _core.ModelConfig, context: int, kv_bytes: int = 4) -> dict[str, int]:
    H, D, Hq, Hkv = c.hidden, c.head_dim, c.n_heads, c.n_kv_heads
    C = 2 * c.gdn_k_heads * c.gdn_k_dim + c.gdn_v_heads * c.gdn_v_dim
    V = c.gdn_v_heads * c.gdn_v_dim
    n_attn = sum(t == "full_attention" for t in c.layer_types)
    n_gdn = LAYERS - n_attn
    attn = qbytes(Hq * D * 2, H) + 2 * qbytes(Hkv * D, H) + qbytes(H, Hq * D)
    gdn = qbytes(C, H) + qbytes(V, H) + 2 * qbytes(c.gdn_v_heads, H) + qbytes(H, V)
    expert = 2 * qbytes(c.moe_intermediate, H) + qbytes(H, c.moe_intermediate)
    shared = 2 * qbytes(c.shared_intermediate, H) + qbytes(H, c.shared_intermediate)
    moe_dense = qbytes(c.n_experts, H, GATE_BITS) + shared + qbytes(1, H, GATE_BITS)
    return {
        "dense weights": n_attn * attn + n_gdn * gdn + LAYERS * moe_dense + qbytes(c.vocab, H) + qbytes(1, H),
        "active experts": LAYERS * c.top_k * expert,
        "KV": n_attn * (2 * Hkv * context * D * kv_bytes + 2 * Hkv * D * kv_bytes),
        "DeltaNet + conv state": n_gdn * 2 * (c.gdn_v_heads * c.gdn_k_dim * c.gdn_v_dim * 4
                                              + (c.conv_kernel - 1) * C * 4),
    }


def plan(c, context, kv_half=False):
    rows, (dispatches, barriers, cbs, waits), _scratch = _core.gpu_plan(
        c, context, BITS, GROUP, GATE_BITS, kv_half=kv_half)
    kernels = Counter(r[0] for r in rows)
    by_kernel = defaultdict(int)
    for name, _stage, wb, sb, ob in rows:
        by_kernel[name] += wb + sb + ob
    return {
        "dispatches": dispatches,
        "stages": barriers + 1,
        "command buffers": cbs,
        "CPU waits": waits,
        "weights": sum(r[2] for r in rows),
        "state": sum(r[3] for r in rows),
        "activations": sum(r[4] for r in rows),
        "kernels": kernels,
        "by_kernel": by_kernel,
    }


def minimum_chunk_weight_bytes(c: _core.ModelConfig, T: int) -> int:
    """Checkpoint bytes a prefill chunk of T tokens must read at least once: everything but the
    experts, plus min(T*k, E) experts per MoE layer (the embedding counted as T rows)."""
    H = c.hidden
    expert = 2 * qbytes(c.moe_intermediate, H) + qbytes(H, c.moe_intermediate)
    row = qbytes(1, H)  # one embedding row (minimum_bytes counts one)
    dense = minimum_bytes(c, 1)["dense weights"]
    return dense + (T - 1) * row + LAYERS * min(T * c.top_k, c.n_experts) * expert


def prefill_plan(c, prompt: int, chunk: int = 512, kv_half: bool = False) -> dict:
    p = _core.gpu_plan_prefill(c, prompt, chunk, BITS, GROUP, GATE_BITS, kv_half)
    rows = p["last_chunk"]
    d, b, cbs, w = p["last_stats"]
    attn_state = sum(r[3] for r in rows if r[0].startswith("attn_prefill") or r[0].startswith("attn_decode"))
    return {
        "chunks": p["chunks"],
        "last tokens": p["last_tokens"],
        "dispatches": d,
        "stages": b + 1,
        "command buffers": cbs,
        "waits in chunk": p["waits_inside_chunks"],
        "waits": p["total"][3],
        "weights": sum(r[2] for r in rows),
        "KV read": attn_state,
        "state": sum(r[3] for r in rows),
        "device": p["device_bytes"],
        "seq state": p["state_bytes"],
        "kernels": Counter(r[0] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (docs/metal.md)")
    args = ap.parse_args()
    c = config_35b()
    GB = 1e9
    results = {(ctx, kv): (plan(c, ctx, kv == "f16"), minimum_bytes(c, ctx, 2 if kv == "f16" else 4))
               for kv in ("f32", "f16") for ctx in args.contexts}

    print("| context | KV cache | kernels | stages | command buffers | CPU waits | weights GB | state GB | "
          "activations GB | total GB | minimum GB | total / minimum |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (ctx, kv), (p, m) in results.items():
        total = p["weights"] + p["state"] + p["activations"]
        mn = sum(m.values())
        print(f"| {ctx:,} | {kv} | {p['dispatches']} | {p['stages']} | {p['command buffers']} | {p['CPU waits']} | "
              f"{p['weights'] / GB:.3f} | {p['state'] / GB:.3f} | {p['activations'] / GB:.4f} | "
              f"{total / GB:.3f} | {mn / GB:.3f} | {total / mn:.3f} |")
    print()
    ctx0 = args.contexts[0]
    p0, m0 = results[(ctx0, "f32")]
    print(f"Minimum at {ctx0:,}: " + ", ".join(f"{k} {v / GB:.3f} GB" for k, v in m0.items()))
    print()
    print(f"| kernel | dispatches per step | GB per step at {ctx0:,} |")
    print("|---|---:|---:|")
    for name, n in sorted(p0["kernels"].items(), key=lambda kv: -p0["by_kernel"][kv[0]]):
        print(f"| {name} | {n} | {p0['by_kernel'][name] / GB:.4f} |")

    print()
    print(f"Prefill in chunks of {args.chunk} (the last chunk of each prompt; it is a full chunk here):")
    print()
    print("| prompt | chunks | kernels per chunk | stages per chunk | CPU waits inside chunks | CPU waits in all | "
          "weights GB per chunk | minimum GB per chunk | KV read GB (last chunk) | state GB | scratch MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    last = None
    for n in args.prompts:
        p = last = prefill_plan(c, n, args.chunk)
        mn = minimum_chunk_weight_bytes(c, p["last tokens"])
        print(f"| {n:,} | {p['chunks']} | {p['dispatches']} | {p['stages']} | {p['waits in chunk']} | {p['waits']} | "
              f"{p['weights'] / GB:.3f} | {mn / GB:.3f} | {p['KV read'] / GB:.4f} | {p['seq state'] / GB:.3f} | "
              f"{(p['device'] - p['seq state']) / 2**20:.1f} |")
    if last:
        print()
        print("| kernel | dispatches per chunk |")
        print("|---|---:|")
        for name, n in sorted(last["kernels"].items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {n} |")


if __name__ == "__main__":
    main()
