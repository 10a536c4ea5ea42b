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

Continuous batching (--batches, default 1 4 8; issue 19): one decode step of B sequences at the
first context (f16 KV, the GPU default), in the passes Engine.step makes (a pass of several
sequences holds at most GpuBackend::batch_rows() = 7 rows, so 8 sequences are passes of 7 and
1), and the bytes per generated token: dense weights are read once per pass, the embedding
row, the routed experts, the KV cache and the DeltaNet state per sequence. The plan counts
min(B*k, E) experts per MoE layer for a pass of B rows (every row's experts distinct: an upper
bound; real routing overlaps).

With --json the same runs are printed as one JSON object instead of tables: per decode context
(and KV cache type) and per prompt's last prefill chunk, one object per dispatch (kernel,
stage, threadgroups, threads_per_threadgroup, weight_bytes, state_bytes, other_bytes) and the
step's totals; for decode also an ESTIMATE of tokens/s on M-series GPUs from a simple model
(see estimate_decode: bandwidth, GPU cores and threadgroup-count-limited occupancy are
parameters, nothing there was measured on Apple hardware).

    PYTHONPATH=src python benchmarks/metal_plan.py [--contexts 4096 32768 131072] [--prompts 512 4096 32768]
    PYTHONPATH=src python benchmarks/metal_plan.py --json > plan.json
    PYTHONPATH=src python benchmarks/metal_plan.py --contexts 4096 --prompts --batches 1 4 8
"""

from __future__ import annotations

import argparse
import json
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


def gemv_loads(c: _core.ModelConfig) -> list[dict]:
    """The decode GEMVs' reads per matrix kind of the shape (issue 16): serial load steps a
    simdgroup makes for its 4 rows, with 16-byte loads per lane (QuantMatrix.vec, where the host's
    rule kernel_args.vector_rows allows it; moe_down's jobs on teams of kernel_args.moe_down_lanes
    lanes) against the 32-bit words of one lane team per job, one job after another (before).
    Threadgroups per dispatch are the same either way (8 rows each)."""
    A = _core.kernel_args
    H, V = c.hidden, c.gdn_v_heads * c.gdn_v_dim

    def matrix(inp, bits, vec):
        m = A.QuantMatrix(in_=inp, out=8, bits=bits, group=GROUP)
        m.vec = int(vec and A.vector_rows(m, [0]))
        return m

    def loads(m):  # per row, as metal/quant.h reads it
        return m.in_ * m.bits // (128 if m.vec else 32)

    def down_steps(m, lanes, jobs):  # the busiest team's steps (job j on team j % teams)
        teams = 32 // lanes
        return max(sum(-(-loads(m) // lanes) for _ in range(p, jobs, teams)) for p in range(teams))

    rows = []
    for kind, inp, bits in (("gemv: projections of h, lm_head, moe_gate_up", H, BITS), ("gemv: router", H, GATE_BITS),
                            ("gemv: o_proj", c.n_heads * c.head_dim, BITS), ("gemv: out_proj (DeltaNet)", V, BITS)):
        before, after = matrix(inp, bits, False), matrix(inp, bits, True)
        rows.append({"kind": kind, "in": inp, "bits": bits, "row_bytes": inp * bits // 8,
                     "before": {"load_bytes": 4, "lanes": 32, "steps": -(-loads(before) // 32)},
                     "after": {"load_bytes": 16 if after.vec else 4, "lanes": 32, "steps": -(-loads(after) // 32)}})
    jobs = c.top_k + 1
    before, after = matrix(c.moe_intermediate, BITS, False), matrix(c.moe_intermediate, BITS, True)
    lanes = A.moe_down_lanes(after, after, c.top_k)
    rows.append({"kind": f"moe_down: {c.top_k} experts + shared", "in": c.moe_intermediate, "bits": BITS,
                 "row_bytes": c.moe_intermediate * BITS // 8,
                 "before": {"load_bytes": 4, "lanes": 32, "steps": down_steps(before, 32, jobs)},
                 "after": {"load_bytes": 16 if after.vec else 4, "lanes": lanes,
                           "steps": down_steps(after, lanes, jobs)}})
    return rows


# Parameters of the decode estimate. Assumptions, not measurements: M1 Max's published 32 GPU
# cores and 400 GB/s; an M5 Max-like part taken as 40 cores and 614 GB/s. `efficiency` is the
# fraction of peak bandwidth a streaming kernel reaches with the GPU full, `threadgroups_per_core`
# how many resident threadgroups a core needs to hide memory latency, `stage_us` the cost of a
# memory barrier between dependent dispatches of the concurrent encoder.
GPU_MODELS = {
    "M1 Max-like": dict(cores=32, bandwidth_gbs=400.0),
    "M5 Max-like": dict(cores=40, bandwidth_gbs=614.0),
}
ESTIMATE_DEFAULTS = dict(efficiency=0.8, threadgroups_per_core=4, stage_us=2.0)


def dispatch_objects(rows) -> list[dict]:
    """gpu_plan's rows as the JSON report's dispatch objects."""
    keys = ("kernel", "stage", "weight_bytes", "state_bytes", "other_bytes", "threadgroups", "threads_per_threadgroup")
    return [dict(zip(keys, r, strict=True)) for r in rows]


def estimate_decode(dispatches: list[dict], cores: int, bandwidth_gbs: float, efficiency: float,
                    threadgroups_per_core: int, stage_us: float) -> dict:
    """ESTIMATE of one decode step's time on a GPU with `cores` cores and `bandwidth_gbs` peak:
    every dispatch is bandwidth-bound (batch-1 decode is), streaming its declared bytes at
    efficiency x peak scaled by its occupancy min(1, threadgroups / (cores x
    threadgroups_per_core)) (a dispatch of few threadgroups cannot keep the memory system busy),
    plus stage_us per dependency stage. A model of the plan's shape, not a measurement."""
    seconds = 0.0
    for d in dispatches:
        occupancy = min(1.0, d["threadgroups"] / (cores * threadgroups_per_core))
        nbytes = d["weight_bytes"] + d["state_bytes"] + d["other_bytes"]
        seconds += nbytes / (bandwidth_gbs * 1e9 * efficiency * occupancy)
    stages = len({d["stage"] for d in dispatches})
    seconds += stages * stage_us * 1e-6
    return {"step_ms": seconds * 1e3, "tokens_per_s": 1.0 / seconds}


def plan(c, context, kv_half=False, batch=1):
    rows, (dispatches, barriers, cbs, waits), _scratch = _core.gpu_plan(
        c, context, BITS, GROUP, GATE_BITS, kv_half=kv_half, batch=batch)
    kernels = Counter(r[0] for r in rows)
    by_kernel = defaultdict(int)
    for name, _stage, wb, sb, ob, _tgs, _threads in rows:
        by_kernel[name] += wb + sb + ob
    return {
        "rows": dispatch_objects(rows),
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


def batch_plan(c, context: int, batch: int) -> dict:
    """One decode step of `batch` sequences at `context` (f16 KV), per generated token."""
    p = plan(c, context, True, batch)
    per_token = {k: p[k] / batch for k in ("weights", "state", "activations")}
    return {"batch": batch, "context": context, "kv_cache": "f16", "passes": p["command buffers"],
            "dispatches": p["dispatches"], "stages": p["stages"], "totals": totals(p),
            "per_token": {"weight_bytes": per_token["weights"], "state_bytes": per_token["state"],
                          "other_bytes": per_token["activations"], "total_bytes": sum(per_token.values())}}


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
        "rows": dispatch_objects(rows),
    }


def totals(p: dict) -> dict:
    """A step's totals in the JSON report (decode plan() or prefill_plan() results)."""
    return {
        "dispatches": p["dispatches"],
        "stages": p["stages"],
        "command_buffers": p["command buffers"],
        "cpu_waits": p["CPU waits"] if "CPU waits" in p else p["waits in chunk"],
        "weight_bytes": sum(d["weight_bytes"] for d in p["rows"]),
        "state_bytes": sum(d["state_bytes"] for d in p["rows"]),
        "other_bytes": sum(d["other_bytes"] for d in p["rows"]),
    }


def json_report(c, contexts: list[int], prompts: list[int], chunk: int,
                batches: tuple[int, ...] = (1, 4, 8)) -> dict:
    decode = []
    for kv in ("f32", "f16"):
        for ctx in contexts:
            p = plan(c, ctx, kv == "f16")
            decode.append({
                "context": ctx, "kv_cache": kv, "dispatches": p["rows"], "totals": totals(p),
                "estimate": {name: estimate_decode(p["rows"], **gpu, **ESTIMATE_DEFAULTS)
                             for name, gpu in GPU_MODELS.items()},
            })
    prefill = []
    for n in prompts:
        p = prefill_plan(c, n, chunk)
        prefill.append({"prompt": n, "chunk": chunk, "last_chunk_tokens": p["last tokens"],
                        "dispatches": p["rows"], "totals": totals(p)})
    return {
        "model": "Qwen3.6-35B-A3B shape, MLX affine 4-bit group 64 (router and shared-expert gate 8-bit)",
        "decode": decode,
        "prefill_last_chunk": prefill,
        "decode_batches": [batch_plan(c, contexts[0], b) for b in batches],
        "estimate_note": "ESTIMATE from benchmarks/metal_plan.py estimate_decode (bandwidth-bound dispatches, "
                         "threadgroup-count-limited occupancy); unverified on Apple hardware",
        "estimate_parameters": {"gpus": GPU_MODELS, **ESTIMATE_DEFAULTS},
        "gemv_loads": gemv_loads(c),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--prompts", type=int, nargs="*", default=[512, 4096, 32768])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 4, 8],
                    help="decode batch sizes for the bytes-per-generated-token table")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables (docs/metal.md)")
    ap.add_argument("--json", action="store_true", help="one JSON object: every dispatch, totals, estimates")
    args = ap.parse_args()
    c = config_35b()
    if args.json:
        print(json.dumps(json_report(c, args.contexts, args.prompts, args.chunk, args.batches), indent=1))
        return
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
    print("ESTIMATE (a model, not a measurement; unverified on Apple hardware): decode tokens/s from the plan's "
          f"bytes and threadgroup counts (estimate_decode, {ESTIMATE_DEFAULTS})")
    print()
    print("| context | KV cache | " + " | ".join(f"{n} ({g['cores']} cores, {g['bandwidth_gbs']:.0f} GB/s)"
                                           for n, g in GPU_MODELS.items()) + " |")
    print("|---:|---|" + "---:|" * len(GPU_MODELS))
    for (ctx, kv), (p, _m) in results.items():
        est = [estimate_decode(p["rows"], **g, **ESTIMATE_DEFAULTS)["tokens_per_s"] for g in GPU_MODELS.values()]
        print(f"| {ctx:,} | {kv} | " + " | ".join(f"{e:.0f}" for e in est) + " |")
    print()
    ctx0 = args.contexts[0]
    p0, m0 = results[(ctx0, "f32")]
    print(f"Minimum at {ctx0:,}: " + ", ".join(f"{k} {v / GB:.3f} GB" for k, v in m0.items()))
    print()
    print(f"| kernel | dispatches per step | GB per step at {ctx0:,} |")
    print("|---|---:|---:|")
    for name, n in sorted(p0["kernels"].items(), key=lambda kv: -p0["by_kernel"][kv[0]]):
        print(f"| {name} | {n} | {p0['by_kernel'][name] / GB:.4f} |")

    if args.batches:
        print()
        print(f"Continuous batching: one decode step of B sequences at {ctx0:,} (f16 KV), per generated token "
              "(experts: an upper bound, every row's distinct):")
        print()
        print("| batch | passes | kernels | stages | weights GB / token | state GB / token | activations GB / token | "
              "total GB / token | vs batch 1 |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        base = None
        for b in args.batches:
            bp = batch_plan(c, ctx0, b)
            t = bp["per_token"]
            base = base or t["total_bytes"]
            print(f"| {b} | {bp['passes']} | {bp['dispatches']} | {bp['stages']} | {t['weight_bytes'] / GB:.3f} | "
                  f"{t['state_bytes'] / GB:.4f} | {t['other_bytes'] / GB:.4f} | {t['total_bytes'] / GB:.3f} | "
                  f"{t['total_bytes'] / base:.3f} |")
    print()
    print("Decode GEMV reads (serial load steps of a simdgroup for its 4 rows; threadgroups unchanged):")
    print()
    print("| matrix | in | row bytes | before: bytes per lane load, lanes per job, steps | after |")
    print("|---|---:|---:|---|---|")
    for r in gemv_loads(c):
        b, a = r["before"], r["after"]
        print(f"| {r['kind']} ({r['bits']}-bit) | {r['in']} | {r['row_bytes']} | "
              f"{b['load_bytes']} B, {b['lanes']}, {b['steps']} | {a['load_bytes']} B, {a['lanes']}, {a['steps']} |")
    if not args.prompts:
        return
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
