"""`lily doctor` through the command line, on Linux: the CPU backend and msl-cpu (the Metal
backend's host and kernels run on the CPU); with LILY_TEST_GPU_BACKEND=metal on a Mac, Metal.

References: the report's JSON against its schema (jsonschema); the kernel path and device it
names against the model the Python API loads; the kernel libraries against the files in
metal/; a wrong kernel ($LILY_SOURCE_DIR) must turn the exit status to 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import pytest

from test_cli import run_lily

ROOT = Path(__file__).resolve().parents[1]

KERNEL_ROW = {
    "type": "object",
    "required": ["file", "language", "safe_math", "status", "detail", "seconds"],
    "properties": {"file": {"type": "string", "pattern": r"^metal/\w+\.metal$"},
                   "language": {"enum": ["3.1", "4.0"]}, "safe_math": {"type": "boolean"},
                   "status": {"enum": ["ok", "failed", "skipped"]}, "detail": {"type": "string"},
                   "seconds": {"type": "number", "minimum": 0}},
}
SCHEMA = {
    "type": "object",
    "required": ["lily", "platform", "metal", "auto", "backend", "kernels", "check", "benchmark", "problems", "ok"],
    "properties": {
        "lily": {"type": "object", "required": ["version", "build", "kernels"]},
        "platform": {"type": "object", "required": ["system", "machine", "release", "python"]},
        "metal": {"type": "object", "required": ["present", "usable", "device", "reason"]},
        "auto": {"type": "object", "required": ["backend", "reason", "warning", "check_cached"],
                 "properties": {"backend": {"enum": ["cpu", "metal"]}}},
        "backend": {"type": "object", "required": ["name", "device", "kernel_paths"]},
        "kernels": {"type": "array", "items": KERNEL_ROW},
        "check": {"type": "object", "required": ["passed", "reason"]},
        "benchmark": {"type": "object", "required": ["seconds", "rounds", "prefill_tok_s", "decode_tok_s"],
                      "properties": {"rounds": {"type": "integer", "minimum": 1},
                                     "prefill_tok_s": {"type": "number", "exclusiveMinimum": 0},
                                     "decode_tok_s": {"type": "number", "exclusiveMinimum": 0}}},
        "problems": {"type": "array", "items": {"type": "string"}},
        "ok": {"type": "boolean"},
    },
}
LINUX = sys.platform == "linux"


def doctor_json(*args) -> tuple[int, dict]:
    p = run_lily("doctor", "--json", *args, timeout=600)
    assert p.returncode in (0, 1), p.stderr
    report = json.loads(p.stdout)
    jsonschema.validate(report, SCHEMA)
    return p.returncode, report


def test_doctor_on_the_cpu(lily):
    rc, report = doctor_json("--backend", "cpu", "--seconds", "1")
    assert rc == 0 and report["ok"]
    assert report["backend"]["name"] == "cpu" and report["kernels"] == []
    assert report["check"]["passed"] is None  # the CPU is the check's reference
    assert report["lily"]["version"] == lily.__version__
    assert report["benchmark"]["seconds"] >= 1
    if LINUX:
        assert report["metal"] == {"present": False, "usable": False, "device": None, "reason": "no Metal: Linux"}
        assert report["auto"]["backend"] == "cpu" and report["auto"]["warning"] is None
    mode = lily.Model.load(backend="cpu")._engine.cpu_matmul
    assert report["backend"]["kernel_paths"]["cpu_matmul"].startswith("int8" if mode == "int8" else "f32")


def test_doctor_on_a_gpu_backend(lily, gpu_backend):
    rc, report = doctor_json("--backend", gpu_backend, "--seconds", "0")
    assert rc == 0 and report["ok"], report["check"]
    model = lily.Model.load(backend="msl-cpu")  # on gpu_backend (tests/conftest.py)
    back = report["backend"]
    assert back["kernel_paths"] == {"prefill_gemm": model._engine.gpu_gemm_path}
    assert back["device"] == model._engine.gpu_device.name
    assert back["apple_gpu_family"] == f"Apple{model._engine.gpu_device.apple_gpu_family}"
    files = sorted(f"metal/{p.name}" for p in (ROOT / "metal").glob("*.metal"))
    assert [k["file"] for k in report["kernels"]] == files
    for k in report["kernels"]:
        tensor = k["file"].endswith("_tensor.metal")
        assert k["language"] == ("4.0" if tensor else "3.1")
        assert k["status"] == ("skipped" if tensor and not back["metal4"] else "ok"), k
    assert [k["file"] for k in report["kernels"] if k["safe_math"]] == ["metal/sampling.metal"]
    check = report["check"]
    assert check["passed"] and check["backend"] == gpu_backend and check["max_rel_err"] <= check["tolerance"]


def test_doctor_fails_on_a_wrong_kernel(tmp_path, monkeypatch, gpu_backend):
    (tmp_path / "metal").mkdir()
    text = (ROOT / "metal" / "norm.metal").read_text()
    (tmp_path / "metal" / "norm.metal").write_text(text.replace("const float r = 1.0f / sqrt(",
                                                                "const float r = 1.01f / sqrt("))
    monkeypatch.setenv("LILY_SOURCE_DIR", str(tmp_path))  # run_lily's process inherits it
    rc, report = doctor_json("--backend", gpu_backend, "--seconds", "0")
    assert rc == 1 and not report["ok"]
    assert not report["check"]["passed"] and "differ from the CPU backend's" in report["check"]["reason"]
    assert report["problems"] == [f"the known-answer check failed on {gpu_backend}: {report['check']['reason']}"]


def test_doctor_text_report():
    p = run_lily("doctor", "--seconds", "0")  # --backend auto: the CPU on Linux
    assert p.returncode == 0, p.stderr
    labels = [line.split()[0] for line in p.stdout.splitlines() if line.strip()]
    for label in ("lily", "platform", "metal", "auto", "backend", "known-answer", "benchmark", "result"):
        assert label in labels, p.stdout
    if LINUX:
        assert "no Metal: Linux" in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--backend", "cuda"], "unknown backend 'cuda'"),
    (["--seconds", "-1"], "--seconds must not be negative"),
])
def test_doctor_usage_errors(args, message):
    p = run_lily("doctor", *args)
    assert p.returncode == 2 and message in p.stderr, p.stderr
