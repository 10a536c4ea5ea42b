"""Atheris (coverage-guided, libFuzzer engine) targets for lily's Python loaders and the server.

  python tests/fuzz/py_targets.py TARGET [libFuzzer flags] CORPUS_DIR...   (tests/fuzz/run.sh wraps it)

Targets, and what counts as a clean outcome (anything else propagates and is a crash):
- config:    config.json + generation_config.json + the quantization fields -> load_config,
             load_generation_config, and load_weights of the demo checkpoint under that config
             (where the quantization overrides are read). Clean: success or ValueError
             (ConfigError / CheckpointError are ValueErrors).
- tokenizer: tokenizer.json + tokenizer_config.json -> Tokenizer.from_dir, then encode / decode /
             the incremental detokenizer / the chat template of the config. Clean: success,
             ValueError, or a ChatTemplateError (a ValueError) from the template.
- template:  the input is a chat template, rendered over fixed messages and tools with tight
             budgets. Clean: text or ChatTemplateError, within 3x the time budget (CPU time).
- server:    the input is a request body, POSTed through the server's ASGI app (in process, no
             sockets) to /v1/chat/completions or /v1/completions. Accepted requests stop before
             the scheduler (the harness's _run answers a marker 503), so only validation, the
             chat template and tokenization run. Clean: any status but 500.

Two input modes (first byte even/odd): raw bytes as the document, or structured: the target's
seed document with values at fuzzer-chosen paths replaced by hostile JSON values (huge,
negative, fractional, wrong-typed, deeply nested), which reaches the semantic checks that byte
mutations of JSON rarely get past. Two-document inputs are a 4-byte little-endian length of the
first, then both.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import json
import os
import re
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))
from asgi import post  # noqa: E402

with atheris.instrument_imports(include=["lily"]):
    import lily  # noqa: F401  (instrumented for coverage)
    from lily.chat_template import ChatTemplateError, render
    from lily.checkpoint import load_weights
    from lily.config import load_config
    from lily.generation_config import load_generation_config
    from lily.tokenizer import Tokenizer

DEMO = Path(lily.__file__).resolve().parent / "demo"
WORK = Path(tempfile.mkdtemp(prefix="lily-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))

# Number literals json.dumps cannot write: past Python's 4,300-digit int conversion limit (a
# ValueError out of json.loads), and one that overflows a float. _doc writes them raw.
_RAW = "\x00raw:"
RAW_NUMBERS = [_RAW + "1" * 4400, _RAW + "-" + "9" * 5000, _RAW + "1e999"]

HOSTILE = [None, True, False, 0, -1, 1, 2, 3, 7, 2**31, -(2**31) - 1, 2**63, 10**400 // 10**370, 1e308, -1e-308,
           0.5, float("nan"), float("inf"), "", "x", "\x00", "\ud800", "affine", "mxfp4", "default",
           "full_attention", "linear_attention", "<|im_end|>", [], [1], [None], ["a"] * 3, {}, {"a": 1},
           {"bits": 4}, {"group_size": 32, "bits": 8}, [[[[[]]]]], "a" * 10000, 10**12, 10**9,
           {"type": 5}, {"type": "object", "properties": {"x": {"type": 1.5}}}, *RAW_NUMBERS]


def _hostile(fdp: atheris.FuzzedDataProvider):
    # A fresh copy: edits must never reach into the shared list (and so never build cycles).
    return copy.deepcopy(HOSTILE[fdp.ConsumeIntInRange(0, len(HOSTILE) - 1)])


def _split(data: bytes) -> tuple[bytes, bytes]:
    if len(data) < 4:
        return data, b""
    (n,) = struct.unpack("<I", data[:4])
    body = data[4:]
    n = min(n, len(body))
    return body[:n], body[n:]


def _paths(doc, prefix=()):
    """Every (path) to a value in a JSON document, depth-first."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:64]):
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    if not path:
        return value
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = value
    return doc


def _mutate(seed, fdp: atheris.FuzzedDataProvider, edits: int = 4):
    doc = json.loads(json.dumps(seed))
    for _ in range(fdp.ConsumeIntInRange(1, edits)):
        paths = list(_paths(doc))
        path = paths[fdp.ConsumeIntInRange(0, len(paths) - 1)]
        kind = fdp.ConsumeIntInRange(0, 5)
        if kind == 0:
            value = _hostile(fdp)
        elif kind == 1:
            value = fdp.ConsumeInt(fdp.ConsumeIntInRange(1, 9))
        elif kind == 2:
            value = fdp.ConsumeRegularFloat()
        elif kind == 3:
            value = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 64))
        elif kind == 4:  # delete a key
            if path and isinstance(_get_parent(doc, path), dict):
                del _get_parent(doc, path)[path[-1]]
            continue
        else:  # add a key with a hostile value
            parent = _get_parent(doc, path + ("_",)) if path else doc
            if isinstance(parent, dict):
                parent[fdp.ConsumeUnicodeNoSurrogates(16)] = _hostile(fdp)
            continue
        doc = _set(doc, path, value)
    return doc


def _get_parent(doc, path):
    cur = doc
    for p in path[:-1]:
        cur = cur[p]
    return cur


def _dumps(doc) -> bytes:
    """JSON text of a document, with the RAW_NUMBERS placeholders written as bare literals."""
    return re.sub(r'"\\u0000raw:([^"]*)"', r"\1", json.dumps(doc, allow_nan=True)).encode()


def _doc(data: bytes, seed) -> bytes:
    """The document an input stands for: raw bytes, or the seed with structured edits."""
    if not data or data[0] % 2 == 0:
        return data[1:]
    return _dumps(_mutate(seed, atheris.FuzzedDataProvider(data[1:])))


# -- config ------------------------------------------------------------------------------------

CONFIG_SEED = {"config": json.loads((DEMO / "config.json").read_text()),
               "generation": json.loads((DEMO / "generation_config.json").read_text())}
CONFIG_DIR = WORK / "config"


def config_target(data: bytes) -> None:
    if data and data[0] % 2 == 1:
        doc = _mutate(CONFIG_SEED, atheris.FuzzedDataProvider(data[1:]))
        cfg_bytes = _dumps(doc.get("config") if isinstance(doc, dict) else doc)
        gen_bytes = _dumps(doc.get("generation", {}) if isinstance(doc, dict) else {})
    else:
        cfg_bytes, gen_bytes = _split(data[1:])
    (CONFIG_DIR / "config.json").write_bytes(cfg_bytes)
    (CONFIG_DIR / "generation_config.json").write_bytes(gen_bytes)
    try:
        load_generation_config(CONFIG_DIR)
    except ValueError:
        pass
    try:
        cfg = load_config(CONFIG_DIR)
    except ValueError:
        return
    try:
        load_weights(CONFIG_DIR, cfg)
    except ValueError:
        pass


# -- tokenizer ---------------------------------------------------------------------------------

TOK_SEED = json.loads((DEMO / "tokenizer_config.json").read_text())
TOK_JSON = (DEMO / "tokenizer.json").read_bytes()
TOK_DIR = WORK / "tokenizer"


def tokenizer_target(data: bytes) -> None:
    if data and data[0] % 2 == 1:
        # Structured: the demo's tokenizer.json, a mutated tokenizer_config.json.
        tj, tc = TOK_JSON, _doc(data, TOK_SEED)
    else:
        tj, tc = _split(data[1:])
    (TOK_DIR / "tokenizer.json").write_bytes(tj)
    (TOK_DIR / "tokenizer_config.json").write_bytes(tc)
    try:
        tok = Tokenizer.from_dir(TOK_DIR)
    except ValueError:
        return
    ids = tok.encode("Hello <|im_end|> wörld \U0001f600")
    text = tok.decode(ids)
    detok = tok.detokenizer()
    streamed = "".join(detok.feed(i) for i in ids) + detok.flush()
    if streamed != text:
        raise AssertionError(f"incremental detokenization {streamed!r} != decode {text!r}")
    if tok.chat_template:
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
        except ChatTemplateError:
            pass


# -- template ----------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "content": "42"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
LIMITS = {"max_steps": 20_000, "max_output_chars": 100_000, "max_value_len": 100_000, "timeout_s": 0.5}


def template_target(data: bytes) -> None:
    template = data.decode("utf-8", errors="replace")
    # CPU time, not wall time: on a loaded machine a starved process overruns any wall bound
    # (the budget itself is wall time, so it only gets stricter under load).
    t0 = time.process_time()
    try:
        render(template, MESSAGES, tools=TOOLS, add_generation_prompt=True, limits=LIMITS)
    except ChatTemplateError:
        pass
    elapsed = time.process_time() - t0
    if elapsed > 3 * LIMITS["timeout_s"] + 1.0:
        raise AssertionError(f"template rendering took {elapsed:.1f} s, over its {LIMITS['timeout_s']} s budget")


# -- server ------------------------------------------------------------------------------------

SERVER_SEEDS = {
    "/v1/chat/completions": {"model": "lily-demo", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8,
                             "temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "logprobs": True,
                             "top_logprobs": 2, "stream": False, "seed": 1,
                             "chat_template_kwargs": {"enable_thinking": False}},
    "/v1/completions": {"model": "lily-demo", "prompt": "Once upon", "max_tokens": 4, "logprobs": 1,
                        "stop": "x", "temperature": 0},
}
_server = None


def _app():
    global _server
    if _server is None:
        from lily.server import APIError, Server, build_app

        class ValidatingServer(Server):
            """Stops accepted requests before the scheduler: only validation is fuzzed."""

            async def _run(self, request, job_args):
                raise APIError(503, "accepted (fuzz harness)", code="fuzz_accepted")

        _server = build_app(ValidatingServer(lily.Model.load(), model_id="lily-demo", max_queue=1))
    return _server


_loop = None


def server_target(data: bytes) -> None:
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
    path = list(SERVER_SEEDS)[data[0] % 2 if data else 0]
    body = _doc(data[1:], SERVER_SEEDS[path]) if len(data) > 1 else b""
    status, resp = _loop.run_until_complete(post(_app(), path, body))
    if status == 500 or status == 0:
        raise AssertionError(f"{path} answered {status} to {body[:200]!r}: {resp[:500]!r}")


TARGETS = {"config": config_target, "tokenizer": tokenizer_target, "template": template_target,
           "server": server_target}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: py_targets.py {{{','.join(TARGETS)}}} [libFuzzer flags] [corpus dirs]")
    name = sys.argv.pop(1)
    CONFIG_DIR.mkdir(parents=True, exist_ok=True)
    TOK_DIR.mkdir(parents=True, exist_ok=True)
    # The config target loads the demo weights under fuzzed configs (quantization overrides).
    os.symlink(DEMO / "model.safetensors", CONFIG_DIR / "model.safetensors")
    atexit.register(shutil.rmtree, WORK, ignore_errors=True)
    atheris.Setup(sys.argv, TARGETS[name])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
