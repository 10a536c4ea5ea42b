"""The `lily` command line (python -m lily) on the shipped demo model.

References: the Python API in this process (Model.generate / Model.chat, checked elsewhere
against teacher-forced logits) and the tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lily
from lily.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
# Where the lily under test was imported from (site-packages in CI, src/ in a dev tree):
# subprocesses must see the same one.
LILY_PARENT = str(Path(lily.__file__).resolve().parent.parent)


def run_lily(*args, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=LILY_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "lily", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def model():
    return lily.Model.load()


def test_help_reads_well():
    p = run_lily("--help")
    assert p.returncode == 0
    for cmd in ("generate", "chat", "serve", "convert", "bench", "eval"):
        assert cmd in p.stdout
    sub = build_parser()._subparsers._group_actions[0].choices
    for cmd, parser in sub.items():
        text = parser.format_help()
        assert text.startswith("usage: lily " + cmd), cmd
    assert "--api-key" in sub["serve"].format_help() and "127.0.0.1" in sub["serve"].format_help()
    assert main([]) == 2  # no command: help, non-zero


def test_generate_prints_the_greedy_text(model):
    p = run_lily("generate", "The standard library", "--max-tokens", "12", "--temperature", "0", "-v")
    assert p.returncode == 0, p.stderr
    ref = model.generate("The standard library", max_tokens=12, temperature=0)
    assert p.stdout == ref.text + ("" if ref.text.endswith("\n") else "\n")
    assert "12 generated" in p.stderr and "tok/s" in p.stderr
    assert any(c.isalpha() for c in p.stdout)


def test_generate_reads_stdin_and_chat_flag(model):
    p = run_lily("generate", "-n", "8", "-t", "0", "--chat", stdin="What is a list?")
    assert p.returncode == 0, p.stderr
    ref = model.generate([{"role": "user", "content": "What is a list?"}], max_tokens=8, temperature=0)
    assert p.stdout.rstrip("\n") == ref.text.rstrip("\n")


def test_generate_sampling_flags_are_used(model):
    a = run_lily("generate", "Once upon a time", "-n", "10", "-t", "1.0", "--seed", "5", "--top-k", "50")
    ref = model.generate("Once upon a time", max_tokens=10, temperature=1.0, seed=5, top_k=50)
    assert a.stdout.rstrip("\n") == ref.text.rstrip("\n")


def test_chat_under_a_pipe(model):
    stdin = "What is a list?\n/undo\nWhat is a tuple?\nAnd a set?\n"
    p = run_lily("chat", "-n", "10", "-t", "0", "--system", "Be brief.", stdin=stdin)
    assert p.returncode == 0, p.stderr
    chat = model.chat("Be brief.", temperature=0, max_tokens=10)
    first = chat.send("What is a list?").text
    chat.undo()
    second = chat.send("What is a tuple?").text
    third = chat.send("And a set?").text
    assert p.stdout == "".join(t + "\n" for t in (first, second, third))
    assert "forgotten" in p.stderr


def test_bad_input_is_one_clear_line():
    p = run_lily("generate", "x", "--model", "/nonexistent/model/dir", "-n", "1")
    assert p.returncode == 2
    assert p.stderr.startswith("lily: error:") and "/nonexistent/model/dir" in p.stderr
    assert "Traceback" not in p.stderr
    p = run_lily("generate", "x", "-n", "-3")
    assert p.returncode == 2 and "max_tokens" in p.stderr


def test_bench_table_and_json(tmp_path):
    out = tmp_path / "bench.json"
    p = run_lily("bench", "-p", "16,64", "-d", "4", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "prefill tok/s" in p.stdout and "decode tok/s" in p.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["prompt_tokens"] for r in rows] == [16, 64]
    for r in rows:
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert r["prefill_tok_s"] == pytest.approx(r["prompt_tokens"] / r["prefill_s"])


def test_prefill_progress_reports_each_chunk():
    model = lily.Model.load(prefill_chunk=64)
    calls = []
    ids = list(range(10, 210))
    res = model.generate(ids, max_tokens=2, temperature=0, on_prefill_progress=lambda d, t: calls.append((d, t)))
    assert calls == [(64, 200), (128, 200), (192, 200), (200, 200)]
    assert res.tokens == model.generate(ids, max_tokens=2, temperature=0).tokens
