"""Prompt caches that outlive the process, through the command line and the server.

`lily cache` + `lily generate/chat --prompt-cache` and `lily serve --prompt-cache-dir`, on the
shipped demo model. References: the Python API in this process generating the same prompt from
scratch (nothing cached; checked elsewhere against teacher-forced logits), and the tokenizer.
"""

from __future__ import annotations

import numpy as np
import openai
import pytest

import lily
from fixtures import safetensors_edit as st_edit
from test_cli import run_lily
from test_server import _request, start_server, stop_server

DOC = ("The Gated DeltaNet layers keep a fixed-size state per head, so their memory does not grow with the "
       "context; the attention layers keep a KV cache that does. ") * 6
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 5


@pytest.fixture(scope="module")
def model():
    return lily.Model.load()


@pytest.fixture(scope="module")
def doc_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "doc.txt").write_text(DOC)
    p = run_lily("cache", str(d / "doc.txt"), "--out", str(d / "doc.safetensors"))
    assert p.returncode == 0, p.stderr
    return d / "doc.safetensors", p.stderr


@pytest.fixture(scope="module")
def chat_cache(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "system.txt").write_text(SYSTEM)
    p = run_lily("cache", str(d / "system.txt"), "--chat", "--out", str(d / "system.safetensors"))
    assert p.returncode == 0, p.stderr
    return d / "system.safetensors"


def test_generate_continues_a_cached_text_prompt(model, doc_cache):
    path, log = doc_cache
    cached = model.tokenizer.encode(DOC)
    assert f"cached {len(cached)} tokens" in log
    p = run_lily("generate", "--prompt-cache", str(path), " In short:", "-n", "12", "-t", "0", "-v")
    assert p.returncode == 0, p.stderr
    # The prompt continues the cached text (mlx_lm.generate's rule): its tokens follow the cache's.
    ids = list(cached) + list(model.tokenizer.encode(" In short:"))
    ref = model.generate(ids, max_tokens=12, temperature=0)
    assert p.stdout.rstrip("\n") == ref.text.rstrip("\n")
    assert f"[{len(ids)} prompt tokens ({len(cached)} from the prompt cache)" in p.stderr


def test_generate_and_chat_from_a_cached_system_prompt(model, chat_cache):
    p = run_lily("generate", "--chat", "--prompt-cache", str(chat_cache), "What is a list?", "-n", "10", "-t", "0",
                 "-v")
    assert p.returncode == 0, p.stderr
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a list?"}]
    ref = model.generate(messages, max_tokens=10, temperature=0)
    assert p.stdout.rstrip("\n") == ref.text.rstrip("\n")
    system_ids = model.tokenizer.encode(model.render_chat(messages[:1], add_generation_prompt=False))
    assert f"({len(system_ids)} from the prompt cache)" in p.stderr

    p = run_lily("chat", "--prompt-cache", str(chat_cache), "-n", "10", "-t", "0",
                 stdin="What is a list?\nAnd a tuple?\n")
    assert p.returncode == 0, p.stderr
    chat = model.chat(SYSTEM, temperature=0, max_tokens=10)
    assert p.stdout == "".join(chat.send(q).text + "\n" for q in ("What is a list?", "And a tuple?"))


def test_prompt_cache_misuse_is_one_clear_line(doc_cache, chat_cache, tmp_path):
    doc, _ = doc_cache
    cases = [
        (("generate", "--chat", "--prompt-cache", str(doc), "hi"), "made without --chat"),
        (("generate", "--prompt-cache", str(chat_cache), "hi"), "use it with --chat"),
        (("generate", "--chat", "--system", "Other.", "--prompt-cache", str(chat_cache), "hi"),
         "--system differs from the system prompt cached"),
        (("generate", "--prompt-cache", str(doc), "hi", "--cpu-matmul", "f32"), "cpu_matmul mode"),
    ]
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(doc.read_bytes()[:-64])
    cases.append((("generate", "--prompt-cache", str(truncated), "hi"), "truncated or corrupted"))
    for args, what in cases:
        if "--cpu-matmul" in args and not lily._core.cpu_int8_supported(4, 64, 64):
            continue  # the demo model ran f32 already: no other mode to mismatch
        p = run_lily(*args, "-n", "1")
        assert p.returncode == 2, (args, p.stderr)
        assert p.stderr.startswith("lily: error:") and what in p.stderr and "Traceback" not in p.stderr, p.stderr


# -- lily serve --prompt-cache-dir --------------------------------------------------------------


def _ask(base: str, messages: list[dict]):
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    return client.chat.completions.create(model="lily-demo", messages=messages, max_tokens=12, temperature=0)


def _disk(base: str) -> dict:
    return _request(base, "GET", "/health", timeout=5).json()["cache"]["disk"]


def test_server_prompt_cache_survives_a_restart(model, tmp_path):
    cache_dir = tmp_path / "prompt-cache"
    messages = [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "What is a list?"}]
    ref = model.generate(messages, max_tokens=12, temperature=0)  # from scratch, nothing cached
    args = ("--prompt-cache-dir", str(cache_dir), "--cache-mb", "256")

    proc, base, _ = start_server(*args)
    try:
        first = _ask(base, messages)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        stop_server(proc)
    files = sorted(cache_dir.glob("*.safetensors"))
    assert len(files) == 1  # spilled at shutdown

    proc, base, _ = start_server(*args)
    try:
        assert _disk(base)["sequences"] == 1
        second = _ask(base, messages)
        # All of the prompt but its last token (prefilled again for its logits) came from disk.
        assert second.usage.prompt_tokens_details.cached_tokens == ref.prompt_tokens - 1
        assert second.choices[0].message.content == first.choices[0].message.content
        assert second.usage.completion_tokens == ref.completion_tokens
        assert _disk(base)["loads"] == 1
    finally:
        stop_server(proc)

    # A truncated file and a foreign one (another KV dtype stamped in its metadata) are skipped
    # with a warning and never loaded: the request is served from scratch, with the same answer.
    (good,) = sorted(cache_dir.glob("*.safetensors"))
    raw = good.read_bytes()
    (cache_dir / "truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    header, data = st_edit.read(good)
    header["__metadata__"]["kv_dtype"] = "float16"
    st_edit.write(cache_dir / "foreign.safetensors", header, data)
    good.unlink()
    proc, base, _ = start_server(*args)
    try:
        disk = _disk(base)
        assert disk["sequences"] == 0 and disk["skipped_files"] == 2
        third = _ask(base, messages)
        assert third.usage.prompt_tokens_details.cached_tokens == 0
        assert third.choices[0].message.content == first.choices[0].message.content
    finally:
        log = stop_server(proc)
    assert "skipping" in log and "truncated.safetensors" in log and "foreign.safetensors" in log
    assert "KV cache dtype 'float16'" in log
    assert (cache_dir / "truncated.safetensors").exists()  # left alone, not deleted


def test_damaged_bytes_are_found_when_loading_not_loaded(model, tmp_path):
    """A file whose header is intact but whose tensor bytes were damaged passes the start-up
    index and is refused by the checksum when a request would load it."""
    from lily.prefix_cache import DiskCache, PrefixCache

    cache = PrefixCache(model, 1 << 30, max_snapshots=4)
    ids = list(model.tokenizer.encode(SYSTEM))
    seq, _ = cache.acquire(ids)
    seq.prefill(np.asarray(ids, np.int32))
    seq.take_snapshot()
    disk = DiskCache(model, tmp_path, 1 << 30)
    disk.put(seq)
    (path,) = tmp_path.glob("*.safetensors")
    header, data = st_edit.read(path)
    name = next(k for k in header if k.startswith("state.gdn.") and k.endswith(".S"))
    damaged = bytearray(data)
    damaged[header[name]["data_offsets"][0] + 2] ^= 0x10  # a bit of one DeltaNet state
    st_edit.write(path, header, bytes(damaged))
    fresh = PrefixCache(model, 1 << 30)
    fresh.disk = DiskCache(model, tmp_path, 1 << 30)
    assert len(fresh.disk) == 1
    got, reused = fresh.acquire(ids + [5])
    assert reused == 0 and got.position == 0 and fresh.disk.skipped == 1


def test_evicted_sequences_spill_to_disk_and_come_back(model, tmp_path):
    """A sequence evicted from memory is written to the disk tier, and a later prompt it serves
    loads it back, snapshots included: a prompt diverging after its first prompt still reuses
    that prompt, and the logits equal a fresh state's."""
    from lily.prefix_cache import DiskCache, PrefixCache

    a = list(model.tokenizer.encode(SYSTEM))
    b = list(model.tokenizer.encode(DOC))
    one = PrefixCache(model, 1 << 30)
    seq, _ = one.acquire(a)
    seq.prefill(np.asarray(a, np.int32))
    seq.take_snapshot()
    seq.prefill(np.asarray([7, 8, 9], np.int32))  # generated past the prompt
    budget = seq.nbytes + 1  # room for one sequence
    cache = PrefixCache(model, budget)
    cache.disk = DiskCache(model, tmp_path, 1 << 30)
    cache.release(seq)
    other, _ = cache.acquire(b)
    other.prefill(np.asarray(b, np.int32))
    cache.release(other)  # evicts `seq` to disk
    assert cache.evictions == 1 and len(cache.disk) == 1 and cache.disk.writes == 1

    branch = a + [11, 12]  # shares `a`, not the tokens generated after it
    got, reused = cache.acquire(branch)
    assert reused == len(a) and cache.disk.loads == 1 and len(cache.disk) == 0
    logits = got.prefill(np.asarray(branch[reused:], np.int32))
    np.testing.assert_array_equal(logits, model.logits(branch)[-1])
