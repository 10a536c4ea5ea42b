"""Checkpoint resolution: local folders, and repo ids through a Hugging Face cache laid out
here exactly as huggingface_hub writes it (blobs + refs + snapshot symlinks). No network: each
scenario runs in a fresh interpreter whose HF_HOME is a temporary folder, with HF_HUB_OFFLINE=1
or with the Hub endpoint pointed at a closed port on 127.0.0.1."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import lily
from lily.hub import ALLOW_PATTERNS, resolve_model_path

# The lily under test (site-packages in CI, src/ in a dev tree), for the subprocesses.
SRC = str(Path(lily.__file__).resolve().parent.parent)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_cache(hub_cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    return snap


FILES = {
    "config.json": json.dumps({"model_type": "qwen3_5_moe"}).encode(),
    "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
    "tokenizer.json": b"{}",
}


def run_isolated(tmp_path, code, **env):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    full_env.update(HF_HOME=str(tmp_path / "hf"), PYTHONPATH=SRC, **env)
    script = "import json\nfrom lily.hub import resolve_model_path\n" + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_offline_cache_hit_and_miss(tmp_path):
    snap = make_cache(tmp_path / "hf" / "hub", "org/tiny", FILES)
    out = run_isolated(
        tmp_path,
        f"""
        res = {{}}
        res["main"] = str(resolve_model_path("org/tiny"))
        res["commit"] = str(resolve_model_path("org/tiny", revision="{COMMIT}"))
        try:
            resolve_model_path("org/absent")
        except FileNotFoundError as e:
            res["miss"] = str(e)
        print(json.dumps(res))
        """,
        HF_HUB_OFFLINE="1",
    )
    assert out["main"] == str(snap) and out["commit"] == str(snap)
    assert sorted(os.listdir(out["main"])) == sorted(FILES)
    assert "org/absent" in out["miss"] and "offline" in out["miss"] and str(tmp_path / "hf" / "hub") in out["miss"]


def test_unreachable_hub_falls_back_to_cache(tmp_path):
    snap = make_cache(tmp_path / "hf" / "hub", "org/tiny", FILES)
    out = run_isolated(
        tmp_path,
        """
        res = {"hit": str(resolve_model_path("org/tiny"))}
        try:
            resolve_model_path("org/absent")
        except FileNotFoundError as e:
            res["miss"] = str(e)
        print(json.dumps(res))
        """,
        HF_HUB_OFFLINE="0",
        HF_ENDPOINT="http://127.0.0.1:9",  # nothing listens there: connection refused at once
        HF_HUB_ETAG_TIMEOUT="2",
        HF_HUB_DOWNLOAD_TIMEOUT="2",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    assert out["hit"] == str(snap)
    assert "could not be reached" in out["miss"] or "offline" in out["miss"]


def test_cached_snapshot_without_weights_is_an_error(tmp_path):
    make_cache(tmp_path / "hub", "org/noweights", {"config.json": b"{}"})
    with pytest.raises(FileNotFoundError, match="safetensors"):
        resolve_model_path("org/noweights", cache_dir=tmp_path / "hub", offline=True)


def test_download_asks_only_for_needed_files(tmp_path, monkeypatch):
    import huggingface_hub

    snap = make_cache(tmp_path / "hub", "org/tiny", FILES)
    seen = {}

    def fake_snapshot_download(repo_id, **kw):
        seen.update(kw, repo_id=repo_id)
        return str(snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_path("org/tiny", revision="v1", cache_dir=tmp_path / "hub", offline=False) == snap
    assert seen["repo_id"] == "org/tiny" and seen["revision"] == "v1"
    assert seen["allow_patterns"] == ALLOW_PATTERNS
    assert "*.safetensors" in ALLOW_PATTERNS and not any("bin" in p or "pth" in p for p in ALLOW_PATTERNS)


def test_local_folders(tmp_path):
    (tmp_path / "ckpt").mkdir()
    for name, data in FILES.items():
        (tmp_path / "ckpt" / name).write_bytes(data)
    assert resolve_model_path(tmp_path / "ckpt") == (tmp_path / "ckpt").resolve()
    assert resolve_model_path(str(tmp_path / "ckpt")) == (tmp_path / "ckpt").resolve()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path(str(tmp_path / "missing" / "deeper"))
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path("./nope")
    with pytest.raises(ValueError, match="valid Hugging Face repo id"):
        resolve_model_path("bad id!!")


def test_model_load_from_a_cached_repo_id_offline(tmp_path):
    """lily.Model.load("org/demo") resolves through a Hugging Face cache layout (blobs, refs,
    snapshot symlinks) with the network off, and generates like the folder it came from."""
    demo = Path(lily.__file__).resolve().parent / "demo"
    files = {p.name: p.read_bytes() for p in demo.iterdir() if p.is_file()}
    make_cache(tmp_path / "hf" / "hub", "org/demo", files)
    out = run_isolated(
        tmp_path,
        """
        import lily
        m = lily.Model.load("org/demo")
        r = m.generate("The json module", max_tokens=8, temperature=0)
        print(json.dumps({"path": str(m.path), "tokens": r.tokens}))
        """,
        HF_HUB_OFFLINE="1",
    )
    assert "models--org--demo" in out["path"]
    ref = lily.Model.load().generate("The json module", max_tokens=8, temperature=0)
    assert out["tokens"] == ref.tokens
