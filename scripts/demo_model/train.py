"""Train lily's embedded demo model: a small Qwen3.5/3.6 MoE hybrid on the Python docs + fortunes corpus.

The model is transformers' own `Qwen3_5MoeForCausalLM` (Gated DeltaNet layers, gated full attention
at (i+1) % 4 == 0, top-k routed SwiGLU experts + a sigmoid-gated shared expert), so what is trained
is exactly the released architecture, only smaller. Per-layer shapes keep the real model's head
sizes (DeltaNet key/value heads of 128, attention heads of 256 with a 64-dim partial RoPE, theta
1e7) and its ratios (value heads = 2 x key heads; expert and shared-expert width = hidden / 4), so
the engine's kernels for the real model run unchanged on the demo.

Training: random 512-token windows of the packed token stream (train.bin), AdamW, bf16 autocast
with fp32 master weights, the router's load-balancing loss (coef 1e-3, as in the config), linear
warm-up then cosine decay driven by *wall time* (--seconds), so a fixed device budget always ends on a
fully decayed learning rate. The corpus is small (~4M tokens), so training runs several epochs; the
weights with the best validation loss are the ones saved.

Output (--out): config.json + sharded safetensors in the released composite layout
(`Qwen3_5MoeForConditionalGeneration`: `model.language_model.*`, fused experts
`mlp.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]; bf16 matrices, fp32 vectors),
loss.csv and train_summary.json.

  python train.py --data data --out /tmp/ckpt --seconds 300          # on the GPU
  python train.py --data data --out /tmp/ckpt --smoke                 # a few CPU steps of a tiny twin
  python train.py --dequantize /tmp/ckpt_int8 --out /tmp/ckpt         # --export int8 -> bf16

Sizes (--size): "small" is the first shipped demo (13.4M parameters); "medium" (28.4M: hidden 512,
8 experts of width 128, a shared expert of 256) is the largest whose bf16 checkpoint still comes
back from the device machine in four 16 MB shards (56.8 MB); "large" (44.4M, the second shipped
demo, 25.3 MB at 4-bit) comes back as int8 (--export int8, undone here by --dequantize).
--batch auto times a few steps at batch 32, 64, ... 512 first and
keeps the fastest in tokens per second: with transformers' PyTorch DeltaNet path a step is
dominated by kernel launches, so larger batches are nearly free until the GPU is full.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

VOCAB = 4096
EOT_ID, IM_START_ID, IM_END_ID = 4087, 4088, 4089  # fixed by train_tokenizer.py (checked below)


SIZES = {
    "small": {},
    "medium": dict(hidden_size=512, num_experts=8, moe_intermediate_size=128, shared_expert_intermediate_size=256),
    # 44M parameters, 25 MB at 4-bit. Expert widths stay multiples of 64 (the 4-bit group size
    # runs along down_proj's input). Its bf16 checkpoint (88 MB) is over what a device call
    # returns, so it is exported as int8 (--export int8) and made bf16 again here (--dequantize).
    "large": dict(hidden_size=640, num_experts=8, moe_intermediate_size=192, shared_expert_intermediate_size=320),
}


def text_config(smoke: bool = False, size: str = "small") -> dict:
    """The demo model's text config (real head sizes, everything else scaled down)."""
    cfg = dict(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=8,  # 6 Gated DeltaNet + 2 full attention (layers 3 and 7)
        full_attention_interval=4,
        num_attention_heads=2,  # gated attention: q_proj gives [query 256 | gate 256] per head
        num_key_value_heads=1,
        head_dim=256,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64 * 2,
        shared_expert_intermediate_size=64 * 2,
        router_aux_loss_coef=0.001,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
        eos_token_id=IM_END_ID,
        pad_token_id=EOT_ID,
        bos_token_id=None,
    )
    cfg.update(SIZES[size])
    if smoke:
        cfg.update(
            num_hidden_layers=4,
            hidden_size=128,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        )
    return cfg


def composite_config(tcfg: dict) -> dict:
    """config.json of the released layout: mlx_lm.convert only takes model_type `qwen3_5_moe`."""
    cfg = Qwen3_5MoeTextConfig(**tcfg).to_dict()
    for k in (
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "problem_type",
        "id2label",
        "label2id",
        "tokenizer_class",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "finetuning_task",
        "use_cache",
    ):
        cfg.pop(k, None)
    cfg.pop("_name_or_path", None)
    cfg["model_type"] = "qwen3_5_moe_text"
    cfg["full_attention_interval"] = tcfg["full_attention_interval"]  # mlx-lm reads this key
    cfg["decoder_sparse_step"] = 1
    cfg["norm_topk_prob"] = True
    cfg["dtype"] = "bfloat16"
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": cfg,
        "tie_word_embeddings": False,
        "eos_token_id": IM_END_ID,
        "pad_token_id": EOT_ID,
    }


INT8_SCALE = ".int8_scale"


def int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per row (last dim): a transport format only, 2 bytes a
    weight fewer than bf16; its error (1/254 of a row's largest weight) is far below the 4-bit
    quantization the shipped model gets."""
    w = w.detach().float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def export(
    model: Qwen3_5MoeForCausalLM | None, tcfg: dict | None, out: Path, state=None, shard_mb: float = 16.0,
    int8: bool = False,
) -> None:
    """Write the checkpoint in the released composite layout (fused experts): matrices in bf16 like
    the released checkpoints, 1-D tensors (norms, A_log, dt_bias) in fp32; sharded under shard_mb
    (the device returns at most 8 files of at most 16 MiB) with the usual model.safetensors.index.json.
    int8: matrices as int8 + per-row scales instead (undone by dequantize())."""
    out.mkdir(parents=True, exist_ok=True)
    state = state if state is not None else model.state_dict()
    tensors = {}
    for k, v in state.items():
        if k.startswith("model.") and not k.startswith("model.language_model."):
            k = "model.language_model." + k[len("model.") :]
        if int8 and v.ndim >= 2:
            tensors[k], tensors[k + INT8_SCALE] = int8_rows(v.to("cpu"))
            continue
        tensors[k] = (
            v.detach().to("cpu", torch.bfloat16 if v.ndim >= 2 else torch.float32).contiguous()
        )
    assert (
        "lm_head.weight" in tensors
        and "model.language_model.layers.0.mlp.experts.gate_up_proj" in tensors
    )
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if cur and size + nbytes > shard_mb * 1e6:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = tensors[k]
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n"
    )
    if tcfg:
        (out / "config.json").write_text(json.dumps(composite_config(tcfg), indent=2) + "\n")


def dequantize(src: Path, out: Path) -> None:
    """An --export int8 checkpoint back to the usual bf16 one (config, loss.csv and summary copied)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for k in [k for k in state if k.endswith(INT8_SCALE)]:
        w = k[: -len(INT8_SCALE)]
        state[w] = state[w].float() * state.pop(k)
    tcfg = json.loads((src / "config.json").read_text())["text_config"]
    export(None, None, out, state=state, shard_mb=1e9)
    for name in ("config.json", "loss.csv", "train_summary.json"):
        if (src / name).exists():
            (out / name).write_bytes((src / name).read_bytes())
    print(f"dequantized {src} -> {out} ({sum(v.numel() for v in state.values()) / 1e6:.2f}M values)", tcfg["hidden_size"])


def use_fast_delta_rule(device: str) -> bool:
    """Keep flash-linear-attention's Triton chunked gated delta rule (what transformers picks when
    `fla` is importable) only if it runs here and agrees with transformers' PyTorch reference on a
    random input, forward and backward; otherwise put the reference back. The reference is a
    Python loop over 64-token chunks, so on the GPU the kernel is the difference between a
    launch-bound step and a full one."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    fast = m.torch_chunk_gated_delta_rule
    ref = getattr(fast, "__wrapped__", None)
    if device != "cuda" or ref is None:
        return False
    try:
        import fla.ops.gated_delta_rule  # noqa: F401  (what transformers imported, if it could)

        gen = torch.Generator(device="cuda").manual_seed(0)
        B, T, H, HV, D = 2, 256, 2, 4, 128  # the demo's DeltaNet heads: 2 key, 4 value, dim 128

        def inputs():
            r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
            q, k, v = r(B, T, H, D), r(B, T, H, D), r(B, T, HV, D)
            g = -torch.nn.functional.softplus(r(B, T, HV))
            beta = torch.sigmoid(r(B, T, HV))
            return [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)] + [g.requires_grad_(), beta.requires_grad_()]

        args = inputs()
        outs = []
        for fn in (fast, ref):
            xs = [a.detach().clone().requires_grad_() for a in args]
            o, _ = fn(*xs[:3], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True)
            o.float().square().sum().backward()
            outs.append([o.float()] + [x.grad.float() for x in xs])
        worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in zip(*outs, strict=True))
        ok = worst < 0.1  # bf16 inputs; a wrong kernel is off by O(1)
        print(f"fla chunk_gated_delta_rule: max relative difference from the reference {worst:.2e}", flush=True)
    except Exception as e:  # not importable, no kernel for this GPU, ...
        print(f"fla chunk_gated_delta_rule unusable ({type(e).__name__}: {e}); the PyTorch path is used", flush=True)
        ok = False
    if not ok:
        m.torch_chunk_gated_delta_rule = ref
    return ok


def batches(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """Random windows of seq tokens from the token stream (already on the device): inputs and
    labels alike (HF shifts labels itself)."""
    offsets = torch.arange(seq, device=tokens.device)
    while True:
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen, device=tokens.device)
        yield tokens[starts[:, None] + offsets].long()


def pick_batch(model, opt, tokens: torch.Tensor, seq: int, amp, candidates=(32, 64, 128, 256, 512)) -> int:
    """The batch with the most tokens per second over a few timed steps (the weights are put back
    afterwards, so the probe does not train the model). Stops at the first that runs out of memory."""
    cuda = tokens.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    gen = torch.Generator(device=tokens.device).manual_seed(1)
    best, best_rate = candidates[0], 0.0
    for b in candidates:
        try:
            stream = batches(tokens, b, seq, gen)
            for i in range(4):  # 1 warm-up, 3 timed
                if i == 1:
                    sync()
                    t0 = time.time()
                x = next(stream)
                with amp():
                    loss = model(input_ids=x, labels=x).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sync()
            rate = 3 * b * seq / (time.time() - t0)
        except torch.OutOfMemoryError:
            break
        print(f"batch {b}: {rate / 1e3:.0f}k tokens/s", flush=True)
        if rate > best_rate * 1.05:  # a larger batch must pay for its fewer optimizer steps
            best, best_rate = b, rate
    model.load_state_dict(state)
    opt.load_state_dict(opt_state)
    opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.empty_cache()
    return best


@torch.no_grad()
def evaluate(model, val: torch.Tensor, seq: int, n_windows: int, amp) -> float:
    """Mean next-token cross-entropy over fixed, evenly spaced validation windows."""
    model.eval()
    starts = torch.linspace(0, val.numel() - seq - 1, n_windows, device=val.device).long()
    offsets = torch.arange(seq, device=val.device)
    total, count = 0.0, 0
    # 64 windows a forward (the logits are 0.5 GB): the PyTorch DeltaNet path is launch-bound, so
    # fewer, larger forwards cost less of the wall-time budget than 16-window ones.
    for i in range(0, n_windows, 64):
        x = val[starts[i : i + 64, None] + offsets].long()
        with amp():
            out = model(input_ids=x, labels=x)
        total += out.loss.item() * x.numel()
        count += x.numel()
    model.train()
    return total / count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=300.0, help="wall-time budget for the steps")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--batch", default="64", help="sequences per step, or auto (timed on the GPU)")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=100, help="steps between validations")
    ap.add_argument("--eval-seconds", type=float, default=None,
                    help="validate every this many seconds instead (the step rate is not known ahead)")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny model, few steps, CPU: proves the script"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export", choices=("bf16", "int8"), default="bf16",
                    help="matrix format of the written checkpoint (int8: see dequantize)")
    ap.add_argument("--dequantize", default=None, metavar="INT8_CKPT",
                    help="turn an --export int8 checkpoint into the usual bf16 one in --out, and exit")
    args = ap.parse_args()
    if args.dequantize:
        dequantize(Path(args.dequantize), Path(args.out))
        return

    torch.manual_seed(args.seed)
    data, out = Path(args.data), Path(args.out)
    tok = json.loads((data / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert (ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]) == (
        EOT_ID,
        IM_START_ID,
        IM_END_ID,
    )
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    fast_delta_rule = use_fast_delta_rule(device)
    # The whole token stream lives on the device (uint16 -> int32: 4 bytes a token), so a batch
    # is one gather, whatever its size.
    train = torch.from_numpy(np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int32)).to(device)
    val = torch.from_numpy(np.fromfile(data / "val.bin", dtype=np.uint16).astype(np.int32)).to(device)
    if args.smoke:  # tiny and quick, but through the same code paths (--batch auto, --eval-seconds)
        args.seq, args.eval_every, args.warmup = 64, 4, 2
        args.batch = args.batch if args.batch == "auto" else "2"
    tcfg = text_config(args.smoke, args.size)
    config = Qwen3_5MoeTextConfig(**tcfg)
    config.output_router_logits = True  # adds router_aux_loss_coef * load-balancing loss
    model = Qwen3_5MoeForCausalLM._from_config(config, attn_implementation="sdpa").to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"params {n_params / 1e6:.2f}M  device {device}  train {train.numel()} val {val.numel()} tokens",
        flush=True,
    )

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "conv1d" not in n else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=(device == "cuda"),
    )

    def amp():
        if device == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)

    if args.batch == "auto":
        args.batch = pick_batch(model, opt, train, args.seq, amp, (1, 2) if args.smoke else (32, 64, 128, 256, 512))
        print(f"batch {args.batch}", flush=True)
    args.batch = int(args.batch)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    stream = batches(train, args.batch, args.seq, gen)
    log = ["step,tokens,seconds,lr,train_loss,val_loss"]
    next_eval = args.eval_seconds
    best = (float("inf"), None, 0)
    t0 = time.time()
    step, smooth = 0, None
    eval_s = 0.0  # wall time spent validating (and keeping the best weights) inside the budget
    max_steps = 12 if args.smoke else 10**9
    while step < max_steps:
        elapsed = time.time() - t0
        frac = min(elapsed / args.seconds, 1.0)
        if frac >= 1.0:
            break
        lr = (
            args.lr
            * min(1.0, (step + 1) / args.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(stream)
        with amp():
            res = model(input_ids=x, labels=x)
        loss = res.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ce = (
            (loss - config.router_aux_loss_coef * res.aux_loss).item()
            if step % 10 == 0 or args.smoke
            else None
        )
        if ce is not None:
            smooth = ce if smooth is None else 0.8 * smooth + 0.2 * ce
        due = (time.time() - t0 >= next_eval) if args.eval_seconds else step % args.eval_every == 0
        if due:
            if args.eval_seconds:
                next_eval += args.eval_seconds
            te = time.time()
            v = evaluate(model, val, args.seq, 8 if args.smoke else 128, amp)
            el = time.time() - t0
            eval_s += el - (te - t0)
            log.append(f"{step},{step * args.batch * args.seq},{el:.1f},{lr:.6f},{smooth or float('nan'):.4f},{v:.4f}")
            print(log[-1], flush=True)
            if v < best[0]:
                best = (
                    v,
                    {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()},
                    step,
                )
            eval_s += time.time() - t0 - el  # the copy of the best weights counts too
    v = evaluate(model, val, args.seq, 8 if args.smoke else 128, amp)
    el = time.time() - t0
    log.append(f"{step},{step * args.batch * args.seq},{el:.1f},{lr:.6f},{smooth or float('nan'):.4f},{v:.4f}")
    print(log[-1], flush=True)
    if v <= best[0]:
        best = (v, None, step)
    out.mkdir(parents=True, exist_ok=True)
    (out / "loss.csv").write_text("\n".join(log) + "\n")
    export(model, tcfg, out, state=best[1], int8=args.export == "int8")
    summary = dict(
        steps=step,
        seconds=round(el, 1),
        tokens=step * args.batch * args.seq,
        epochs=round(step * args.batch * args.seq / train.numel(), 2),
        size=args.size,
        params=n_params,
        best_val_loss=round(best[0], 4),
        best_step=best[2],
        batch=args.batch,
        seq=args.seq,
        lr=args.lr,
        warmup=args.warmup,
        eval_seconds=args.eval_seconds,
        evals=len(log) - 1,
        eval_seconds_spent=round(eval_s, 1),
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        torch=torch.__version__,
        fla_delta_rule=fast_delta_rule,
    )
    import transformers

    summary["transformers"] = transformers.__version__
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
