"""The `lily` command line (python -m lily) on the shipped demo model.

References: the Python API in this process (Model.generate / Model.chat, checked elsewhere
against teacher-forced logits) and the tokenizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


# -- habits of mlx-lm / llama.cpp users, exit codes, help ----------------------------------------


def test_stop_takes_c_escapes(model):
    ref = model.generate("The json module", max_tokens=40, temperature=0, stop=["\n\n"])
    assert ref.finish_reason == "stop"  # the greedy text has a blank line within 40 tokens
    p = run_lily("generate", "The json module", "-n", "40", "-t", "0", "--stop", r"\n\n")
    assert p.returncode == 0, p.stderr
    assert p.stdout == ref.text + "\n"
    p = run_lily("generate", "x", "--stop", "\\q")
    assert p.returncode == 2 and "--stop" in p.stderr and "Traceback" not in p.stderr


def test_prompt_flag_as_in_mlx_lm(model):
    ref = model.generate("The standard library", max_tokens=12, temperature=0)
    p = run_lily("generate", "-p", "The standard library", "-n", "12", "-t", "0")
    assert p.returncode == 0, p.stderr
    assert p.stdout.rstrip("\n") == ref.text.rstrip("\n")


@pytest.mark.parametrize("args, what", [
    (("generate", ""), "empty"),
    (("generate", "x", "--max-tokens", "abc"), "max-tokens"),
    (("generate", "x", "--no-such-flag"), "unrecognized"),
    (("generate", "x", "--system", "Be brief."), "--chat"),
    (("generate", "x", "--think"), "--chat"),
    (("generate", "x", "-p", "y"), "once"),
    (("generate", "x", "--chat-template-kwargs", '{"preserve_thinking": true}'), "--chat"),
    (("generate", "x", "--chat", "--chat-template-kwargs", "{preserve_thinking: true}"),
     "argument --chat-template-kwargs: not valid JSON"),
    (("chat", "--chat-template-kwargs", '["preserve_thinking"]'),
     "argument --chat-template-kwargs: must be a JSON object"),
    (("generate", "x", "--chat", "--no-think", "-n", "1", "--chat-template-kwargs", '{"enable_thinking": true}'),
     "enable_thinking=False disagrees with chat_template_kwargs['enable_thinking']=True"),
    (("bench", "-p", "16,abc"), "prompt-lengths"),
])
def test_user_errors_exit_2_with_one_line(args, what):
    p = run_lily(*args)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert what in p.stderr and "Traceback" not in p.stderr


def test_help_states_each_default_once():
    sub = build_parser()._subparsers._group_actions[0].choices
    for cmd, parser in sub.items():
        for action in parser._actions:
            text = parser._get_formatter()._expand_help(action) if action.help else ""
            assert text.count("default") <= 1, (cmd, action.dest, text)
            assert "(default: None)" not in text, (cmd, action.dest, text)
    gen = sub["generate"].format_help()
    assert "else 256" in gen  # the default --max-tokens


def test_bench_json_to_stdout_is_json_alone():
    p = run_lily("bench", "-p", "16", "-d", "2", "--json", "-")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)["rows"]
    assert [r["prompt_tokens"] for r in rows] == [16]
    assert "prefill tok/s" in p.stderr


def run_without(module: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`lily ARGS` with `module` "not installed": a stand-in package that fails to import, for
    this subprocess only."""
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{module}'\", name='{module}')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), LILY_PARENT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "lily", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def test_eval_without_mlx_is_a_clear_error(tmp_path):
    p = run_without("mlx", tmp_path, "eval", "-N", "8")
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("lily: error:") and "mlx" in p.stderr and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1


def test_serve_without_the_server_extra_is_a_clear_error(tmp_path):
    p = run_without("starlette", tmp_path, "serve", "--port", "1")
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("lily: error:") and '".[server]"' in p.stderr and "Traceback" not in p.stderr


def test_eval_against_mlx_lm_in_float32_by_default():
    # lily in its f32 reference mode: the default (int8 activations) is bounded, not equal
    p = run_lily("eval", "--reference", "mlx-lm", "--cpu-matmul", "f32", "-N", "64", "--json", "-")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["reference"] == "mlx-lm" and r["reference_dtype"] == "float32"
    assert r["top1_agreement"] == 1.0
    assert r["reference_perplexity"] == pytest.approx(r["perplexity"], rel=1e-4)
    assert "(float32)" in p.stderr  # the report names the reference's compute dtype
    native = json.loads(run_lily("eval", "--reference", "mlx", "--reference-dtype", "native", "-N", "8",
                                 "--json", "-").stdout)
    assert native["reference_dtype"] == "bfloat16"


def test_thinking_is_printed_apart_from_the_answer(model):
    messages = [{"role": "user", "content": "What is a list?"}]
    ref = model.generate(messages, enable_thinking=True, max_tokens=16, temperature=0)
    assert ref.reasoning
    p = run_lily("generate", "--chat", "--think", "-n", "16", "-t", "0", stdin="What is a list?")
    assert p.returncode == 0, p.stderr
    assert "thinking: " + ref.reasoning in p.stderr
    assert p.stdout.strip() == ref.content.strip()
    # The same in a chat, switched on with /think on.
    p = run_lily("chat", "-n", "16", "-t", "0", stdin="/think on\nWhat is a list?\n")
    assert p.returncode == 0, p.stderr
    assert "thinking: " + ref.reasoning in p.stderr and ref.reasoning not in p.stdout


def test_chat_template_kwargs_reach_the_template(model):
    """--chat-template-kwargs in generate and chat: the keys are template variables, as the Python
    API's chat_template_kwargs (here enable_thinking given as a key, not with --think)."""
    messages = [{"role": "user", "content": "What is a list?"}]
    ref = model.generate(messages, chat_template_kwargs={"enable_thinking": True}, max_tokens=16, temperature=0)
    assert ref.reasoning and ref.prompt_tokens != model.generate(messages, max_tokens=1).prompt_tokens
    kwargs = ("--chat-template-kwargs", '{"enable_thinking": true}')
    p = run_lily("generate", "--chat", *kwargs, "-n", "16", "-t", "0", "-v", stdin="What is a list?")
    assert p.returncode == 0, p.stderr
    assert "thinking: " + ref.reasoning in p.stderr and f"[{ref.prompt_tokens} prompt tokens" in p.stderr
    assert p.stdout.strip() == ref.content.strip()
    p = run_lily("chat", *kwargs, "-n", "16", "-t", "0", stdin="What is a list?\n")
    assert p.returncode == 0, p.stderr
    assert "thinking: " + ref.reasoning in p.stderr and ref.reasoning not in p.stdout


def test_answer_printer_splits_like_parse_output():
    import io

    from lily.cli import AnswerPrinter
    from lily.tool_calls import parse_output

    pieces = ["  <thi", "nk>\nweigh", "ing it</th", "ink>\n\nThe ans", "wer.", ""]
    out, err = io.StringIO(), io.StringIO()
    printer = AnswerPrinter(False, out, err)
    for piece in pieces:
        printer.write(piece)
    printer.end()
    ref = parse_output("".join(pieces))
    assert out.getvalue() == ref.content + "\n"
    assert err.getvalue() == "thinking: " + ref.reasoning + "\n\n"
    out, err = io.StringIO(), io.StringIO()
    printer = AnswerPrinter(True, out, err)  # the prompt opened the block; cut off while thinking
    for piece in ["still ", "thinking </thi"]:
        printer.write(piece)
    printer.end()
    assert out.getvalue() == "\n" and err.getvalue() == "thinking: still thinking </thi\n\n"


def test_chat_has_line_editing_and_a_history_file(tmp_path):
    """In a terminal (a pty), the up arrow recalls the last line, and the history is saved under
    the user's cache dir."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: lily chat on the pty
        os.environ.update(XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=LILY_PARENT, TERM="xterm")
        os.execv(sys.executable, [sys.executable, "-m", "lily", "chat", "-n", "3", "-t", "0"])
    seen = b""

    def wait_for(needle: bytes, count: int = 1, timeout: float = 60) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while seen.count(needle) < count and time.monotonic() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    seen += os.read(fd, 4096)
                except OSError:
                    break
        assert seen.count(needle) >= count, seen.decode(errors="replace")[-2000:]

    try:
        wait_for(b">>> ")
        os.write(fd, b"What is a list?\r")
        wait_for(b">>> ", 2)
        os.write(fd, b"\x1b[A")  # up arrow: readline brings the last line back
        wait_for(b"What is a list?", 2)  # typed (echoed), then recalled
        os.write(fd, b"\r")
        wait_for(b">>> ", 3)
        os.write(fd, b"/quit\r")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0
    history = (tmp_path / "lily" / "chat_history").read_text()
    assert "What is a list?" in history and "\x1b" not in history
