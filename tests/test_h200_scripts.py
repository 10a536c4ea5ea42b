"""The device scripts of issue 17 (scripts/h200/) and benchmarks/host_loop.py (issue 20), dry-run
on msl-cpu with a tiny checkpoint or the demo model, so a device session does not spend its
minutes finding a broken script.

long_context.py fills a GPU state and a CPU state with the same synthetic KV cache and DeltaNet
state (State.import_tensors) past attention's split threshold, decodes on both and compares
against the CPU backend; the dispatches it records must read exactly the bytes gpu_plan counts
for that context (bf16 scales, as the released checkpoints and make_fullsize.py have: the plan
assumes them), and every step's top-1 must agree.

benchmarks/fullsize/run_llamacpp.sh (llama.cpp's CPU build, and its CUDA build with GPU=cuda) is
checked through DRY_RUN=1: the configure flags (CUDA the only GPU backend, its options at
llama.cpp's defaults), the build targets and the llama-bench commands it would run.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "h200"))
import long_context  # noqa: E402

import fullsize  # noqa: E402


def test_long_context_dry_run(store, tmp_path):
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    rc = long_context.main([str(path), "--backend", "msl-cpu", "--contexts", "300,1100", "--decode", "2",
                            "--out", str(tmp_path)])
    report = json.loads((tmp_path / "long_context.json").read_text())
    assert rc == 0
    assert [r["context"] for r in report["contexts"]] == [300, 1100]
    for r in report["contexts"]:
        assert r["recorded_bytes"] == r["plan_bytes"] and r["recorded_dispatches"] == r["plan_dispatches"]
        for s in r["steps"]:
            assert s["finite"] and s["top1_same"]
            assert s["max_abs_diff"] < 1e-2 * s["logit_scale"]  # f16 KV on the GPU path, f32 on the CPU
    assert "| 1100 | 2 | True |" in (tmp_path / "long_context.md").read_text()


# benchmarks/fullsize/run_llamacpp.sh: llama.cpp's CUDA build on the H200 (GPU=cuda) and its CPU
# build, checked by DRY_RUN=1, which prints the configure, build, GGUF and benchmark commands.
LLAMACPP = ROOT / "benchmarks" / "fullsize" / "run_llamacpp.sh"
GPU_BACKENDS = ("CUDA", "METAL", "VULKAN", "HIP", "MUSA", "SYCL", "OPENCL", "CANN", "WEBGPU", "ZDNN", "ZENDNN",
                "OPENVINO", "HEXAGON", "VIRTGPU")


def _dry_run(tmp_path, **env) -> list[list[str]]:
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), **env)
    out = subprocess.run(["bash", str(LLAMACPP)], env=env, capture_output=True, text=True, check=True, timeout=30)
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()  # nothing ran
    return [shlex.split(line) for line in out.stdout.splitlines() if not line.startswith("#")]


def _on(configure: list[str]) -> set[str]:
    return {b for b in GPU_BACKENDS if f"-DGGML_{b}=ON" in configure}


def test_fullsize_backend_options_dry_run(store, tmp_path):
    """fullsize.py --backend-options (the before/after switch of a kernel change, e.g. the decode
    GEMVs' gemv_words) reaches the GPU load: a bad option name fails the load; a good one runs,
    checked against the CPU backend, and is recorded in the report."""
    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    args = [str(path), "--backend", "msl-cpu", "--contexts", "6", "--decode", "2", "--check-max", "6",
            "--warmup", "0", "--timing-prefill", "0"]
    with pytest.raises(TypeError):
        fullsize.main([*args, "--out", str(tmp_path / "bad"), "--backend-options", '{"gemv_wordz": true}'])
    rc = fullsize.main([*args, "--out", str(tmp_path), "--backend-options", '{"gemv_words": true}'])
    report = json.loads((tmp_path / "fullsize.json").read_text())
    assert rc == 0 and report["backend_options"] == {"gemv_words": True}
    (row,) = report["contexts"]
    assert row["top1_same"] and row["greedy_same"] and row["max_abs_diff"] < 1e-2 * row["logit_scale"]
    assert '(backend_options {"gemv_words": true})' in (tmp_path / "fullsize.md").read_text()


def test_llamacpp_scripts_parse():
    for name in ("prepare_llamacpp.sh", "phase_e.sh", "phase_j.sh", "phase_cpu.sh", "phase_k.sh", "phase_l.sh", "phase_m.sh",
                 "phase_n.sh", "phase_q.sh", "cpu_ab.sh", "cpu_env.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "scripts" / "h200" / name)], check=True)
    subprocess.run(["bash", "-n", str(LLAMACPP)], check=True)


def test_phase_collect_brings_back_the_results_not_the_models(tmp_path):
    """`phase_j.sh collect` (scripts/h200/phase_cpu.sh): the progress log, the roofline and lily
    tables and a tarball of the work folder come back; the model files stay behind (a call
    brings back 8 files of 16 MiB at most)."""
    import tarfile

    work, out = tmp_path / "phase_j", tmp_path / "out"
    (work / "sbs" / "lily_auto").mkdir(parents=True)
    for rel, text in {"progress": "done\n", "roofline_520.txt": "roofline\n", "sbs/total.txt": "total_s=1\n",
                      "sbs/lily_auto/results.md": "| 512 |\n", "sbs/model.safetensors": "w",
                      "sbs/model.gguf": "w"}.items():
        (work / rel).write_text(text)
    subprocess.run(["bash", str(ROOT / "scripts" / "h200" / "phase_j.sh"), "collect"], check=True, cwd=ROOT,
                   env={**os.environ, "W": str(work), "OUT": str(out)}, capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == ["phase_j.tar.gz", "progress", "results.md", "roofline_520.txt",
                                                    "total.txt"]
    with tarfile.open(out / "phase_j.tar.gz") as tf:
        names = tf.getnames()
    assert "./sbs/lily_auto/results.md" in names
    assert not any(n.endswith((".safetensors", ".gguf")) for n in names)


def test_run_llamacpp_server_dry_run(tmp_path):
    """SERVER=1 (phase E's full-size server table): llama-server is configured and built too."""
    configure, build, *_ = _dry_run(tmp_path, SERVER="1", MODE="setup")
    assert "-DLLAMA_BUILD_SERVER=ON" in configure and "-DLLAMA_BUILD_UI=OFF" in configure
    assert build[build.index("--target") + 1:] == ["llama-bench", "llama-batched-bench", "llama-server"]
    configure, build, *_ = _dry_run(tmp_path, MODE="setup")
    assert "-DLLAMA_BUILD_SERVER=OFF" in configure and "llama-server" not in build


def test_run_llamacpp_cuda_dry_run(tmp_path):
    configure, build, make_gguf, *benches = _dry_run(tmp_path, GPU="cuda")
    assert configure[:2] == ["cmake", "-S"] and configure[4].endswith("/build-cuda")
    assert _on(configure) == {"CUDA"} and "-DCMAKE_CUDA_ARCHITECTURES=90" in configure
    # The CUDA options stay at llama.cpp's defaults (flash attention kernels, graphs, MMQ choice).
    assert not [a for a in configure if a.startswith("-DGGML_CUDA_")]
    assert "-DGGML_NATIVE=OFF" in configure and "-DGGML_AMX_INT8=OFF" in configure
    assert build[-3:] == ["--target", "llama-bench", "llama-batched-bench"] and build[build.index("-j") + 1] == "16"
    assert make_gguf[1].endswith("make_gguf.py")
    tests = []
    for cmd in benches:
        assert cmd[0].endswith("/build-cuda/bin/llama-bench")
        assert cmd[cmd.index("-ngl") + 1] == "99" and cmd[-4:] == ["-o", "json", "-oe", "md"]
        assert "-fa" not in cmd and "--flash-attn" not in cmd  # llama-bench's default (auto)
        tests.append(tuple(cmd[cmd.index(f) + 1] if f in cmd else None for f in ("-p", "-n", "-d")))
    assert tests[:3] == [("512", "0", None), ("0", "32", "4096"), ("0", "32", "32768")]
    assert "-v" in benches[0]  # its log says what flash attention "auto" became
    assert len(_dry_run(tmp_path, GPU="cuda", MODE="setup")) == 3  # setup only: no benchmark


def test_run_llamacpp_cpu_dry_run(tmp_path):
    configure, build, _, *benches = _dry_run(tmp_path)
    assert configure[4].endswith("/build") and _on(configure) == set() and "-DGGML_CUDA=OFF" in configure
    for cmd in benches:
        assert cmd[0].endswith("/build/bin/llama-bench") and "-ngl" not in cmd
    assert [cmd[cmd.index("-t") + 2:-4] for cmd in benches] == [
        ["-p", "512", "-n", "16", "-r", "2"],
        ["-p", "4096", "-n", "0", "-r", "1", "--no-warmup"],
        ["-p", "0", "-n", "16", "-d", "4096", "-r", "1", "--no-warmup"],
    ]
    batched = _dry_run(tmp_path, MODE="batched", GPU="cuda", CONTEXTS="512,32768")[3:]
    assert [c[c.index("-npp") + 1] for c in batched] == ["512", "32768"] and all("-ngl" in c for c in batched)


def test_run_llamacpp_rejects_other_gpus(tmp_path):
    r = subprocess.run(["bash", str(LLAMACPP)], env=dict(os.environ, DRY_RUN="1", GPU="rocm"),
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "only cuda" in r.stderr


def test_host_loop_dry_run(tmp_path):
    """benchmarks/host_loop.py (the GPU host-loop cost, for the H200 on msl-cuda) on msl-cpu: the
    device loop ran for (a), (a) and (b) gave the same tokens (the script checks both), and the
    report has the three requests."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import host_loop

    out = tmp_path / "host_loop.json"
    assert host_loop.main(["--backend", "msl-cpu", "--tokens", "4", "--repeat", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["a", "b", "c"]
    assert all(r["ms_per_token_median"] > 0 and r["tokens"] >= 2 for r in report["rows"])


def test_demo_on_gpu_dry_run(tmp_path):
    """scripts/h200/demo_on_gpu.py (the mlx-written demo on msl-cuda against the CPU backend) on
    msl-cpu: the demo's weights are copied to an aligned buffer and it matches the CPU backend."""
    import demo_on_gpu

    out = tmp_path / "demo.json"
    assert demo_on_gpu.main(["--backend", "msl-cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["copied_at_load"] > 0 and report["greedy_equal"]


def test_prefill_kv_traffic_dry_run(store, tmp_path):
    """scripts/h200/prefill_kv_traffic.py (phase I / K: one prefill chunk after a synthetic cached
    context) on msl-cpu, the chunk spanning two attention query tiles: the attn_prefill
    dispatches' declared KV bytes, and its saved logits against the CPU backend on the same
    synthetic state and tokens (f16 KV on the GPU path, f32 on the CPU)."""
    import numpy as np
    import prefill_kv_traffic

    import lily

    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    context, chunk = 40, 300
    logits = tmp_path / "logits.npy"
    assert prefill_kv_traffic.main([str(path), "--backend", "msl-cpu", "--context", str(context), "--chunk",
                                    str(chunk), "--logits", str(logits), "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "prefill_kv.json").read_text())
    assert report["kv_dtype"] == "float16" and report["declared_state_bytes_per_dispatch"] > 0

    cpu = lily.Model.load(path, backend="cpu", cpu_matmul="f32", max_context=context + chunk + 1)
    st = cpu._engine.new_state(context + chunk + 1)
    st.import_tensors(context, long_context.synthetic_state(st.export_tensors(), context, seed=1))
    tokens = np.random.default_rng(2).integers(0, cpu.config.vocab_size, chunk).astype(np.int32)
    want = cpu._engine.prefill(st, tokens, False)
    got = np.load(logits)
    assert got.shape == want.shape and np.isfinite(got).all()
    assert np.abs(got - want).max() < 1e-2 * np.abs(want).max()
    assert got.argmax() == want.argmax()


def test_decode_steps_dry_run(store, capsys, tmp_path):
    """scripts/h200/decode_steps.py (phase L's decode probe) on a tiny checkpoint: one JSON line
    with the CPU backend's default mode and a positive rate, and the --ready file (phase Q starts
    perf when it appears) written."""
    import decode_steps

    path = store.mlx("qwen3_5_moe", 4, 64, "bfloat16")
    ready = tmp_path / "ready"
    assert decode_steps.main([str(path), "--threads", "1", "--steps", "3", "--ready", str(ready)]) == 0
    assert ready.read_text() == "warm\n"
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["threads"] == 1 and line["steps"] == 3 and line["tok_s"] > 0
    assert line["cpu_matmul"] in ("int8", "f32") and line["context"] == 16 + 4 + 3 and line["load_s"] >= 0  # the demo loads in milliseconds
