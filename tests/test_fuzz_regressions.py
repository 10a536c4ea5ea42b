"""Regression tests for the bugs the fuzz targets (tests/fuzz/) and the hardening review found,
one per bug, each written so it failed before its fix (docs/reliability.md lists them).
The fuzz targets' seed corpora also carry the crashing inputs, so short fuzz runs replay them.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

import lily
from lily.config import load_config, parse_config
from lily.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "src" / "lily" / "demo"


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def _builder():
    return lily._core.WeightsBuilder(load_config(DEMO).to_native())


def test_overlap_hidden_by_an_empty_tensor_is_refused(tmp_path):
    """safetensors: A [0, 64) and B [16, 32) overlap; an empty tensor at 8 sat between them in
    begin order, and the neighbour-only check skipped both pairs."""
    f = _raw_safetensors(tmp_path / "x.safetensors", {
        "a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
        "empty": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]},
    }, bytes(64))
    with pytest.raises(lily.CheckpointError, match="'a' and 'b' overlap"):
        _builder().add_file(str(f))


def test_header_with_many_tensors_parses_in_linear_time(tmp_path):
    """json: duplicate-key detection was a linear scan per key; a header of 80,000 (empty)
    tensors took 47 s to open. Opening 4x the tensors must now cost well under the 16x of a
    quadratic parse. CPU time of this process, not wall time: the ratio holds on a loaded
    machine and under the sanitizers (which slow both sizes alike)."""

    def open_cpu_seconds(n: int) -> float:
        header = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
        f = _raw_safetensors(tmp_path / f"many{n}.safetensors", header, b"")
        t0 = time.process_time()
        b = _builder()
        b.add_file(str(f))
        elapsed = time.process_time() - t0
        assert len(b.tensors(0)) == n
        return elapsed

    small, big = open_cpu_seconds(25_000), open_cpu_seconds(100_000)
    assert big < 8 * small + 0.2, f"4x the tensors took {big / small:.1f}x the time ({small:.2f} s -> {big:.2f} s)"
    assert big < 60, f"opening a 100,000-tensor header took {big:.1f} s of CPU"


def test_duplicate_keys_are_still_refused(tmp_path):
    h = b'{"a": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}, "a": {}}'
    f = tmp_path / "dup.safetensors"
    f.write_bytes(struct.pack("<Q", len(h)) + h)
    with pytest.raises(lily.CheckpointError, match='duplicate key \\\\?"a'):
        _builder().add_file(str(f))


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_experts", "max_position_embeddings"])
def test_config_sizes_past_c_int_are_config_errors(field):
    """config: 2**31 reached the native ModelConfig setter and raised a bare TypeError."""
    raw = json.loads((DEMO / "config.json").read_text())
    target = raw.get("text_config", raw)
    target[field] = 2**31
    with pytest.raises(lily.ConfigError, match=field):
        parse_config(raw)


@pytest.mark.parametrize("bits,group", [(2**40, 64), (4, 2**40), (True, 64), (-4, 64)])
def test_quantization_values_past_c_int_are_checkpoint_errors(tmp_path, bits, group):
    """quantization: bits / group_size past a C int raised a TypeError from set_affine."""
    d = tmp_path / "demo"
    shutil.copytree(DEMO, d)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization"]["bits"] = bits
    raw["quantization"]["group_size"] = group
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(lily.CheckpointError, match="bits"):
        lily.Model.load(d)


def test_unpaired_surrogate_in_text_is_a_request_error():
    """tokenizer: a lone surrogate (from a JSON \\ud800 escape) raised a bare TypeError."""
    tok = Tokenizer.from_dir(DEMO)
    with pytest.raises(lily.RequestError, match="U\\+D800 at index 3"):
        tok.encode("abc\ud800def")
    assert tok.encode("abc def") == tok.encode("abc def")


@pytest.fixture(scope="module")
def app():
    from lily.server import Server, build_app

    server = Server(lily.Model.load(), model_id="lily-demo", max_queue=2)
    yield build_app(server)
    server.scheduler.shutdown()


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udc00"}], "max_tokens": 1}'),
    ("/v1/completions", b'{"prompt": "x\\ud83d", "max_tokens": 1}'),
])
def test_server_answers_400_to_unpaired_surrogates(app, path, body):
    """server: a 404 message echoing a surrogate model name could not be encoded (500), and a
    surrogate in a prompt reached the tokenizer (500)."""
    sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
    from asgi import post

    status, resp = asyncio.new_event_loop().run_until_complete(post(app, path, body))
    assert status == 400, resp
    assert json.loads(resp)["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("model_type", [["qwen3_5_moe"], {"a": 1}, 7, None])
def test_non_string_model_type_is_a_config_error(model_type):
    # Found by the config fuzz target (input AQgJACQGByQ=): a list model_type raised TypeError.
    with pytest.raises(lily.ConfigError, match="model_type"):
        parse_config({"model_type": model_type})


def test_float_literal_past_float_range_in_a_chat_template_is_a_template_error():
    """chat template: `8e94697` parses as float('inf'), and Jinja's compiled code names it `inf`,
    a NameError at render time that escaped render() (the template fuzz target, 2026-12-04)."""
    from lily.chat_template import ChatTemplateError, render

    with pytest.raises(ChatTemplateError, match="NameError"):
        render("{% for i in range(8e94697) %}{{ i }}{% endfor %}", [{"role": "user", "content": "hi"}])


def test_join_with_a_huge_list_as_separator_is_refused_before_it_is_built():
    """chat template: the join filter str()s a separator that is not text; a list of 100,000
    references to a 100,000-character string as the separator (small as a list) is 10 GB of
    text, which ran the template fuzz target out of memory (a CI run's 10 s short run,
    2026-12-04). Refused up front by the value limit, with a list of any length to join."""
    from lily.chat_template import ChatTemplateError, render

    messages = [{"role": "user", "content": "hi"}]
    for template in ("{{ (['x' * 100000] * 100000) | join(['x' * 100000] * 100000) | join }}",
                     "{{ [] | join(['x' * 100000] * 100000) }}",
                     "{{ 'ab' | join(d=['x' * 100000] * 100000) }}"):
        with pytest.raises(ChatTemplateError, match="limit"):
            render(template, messages)
    # A list as a separator within the limit still renders as Jinja renders it.
    assert render("{{ ['a', 'b'] | join([1]) }}", messages) == "a[1]b"
