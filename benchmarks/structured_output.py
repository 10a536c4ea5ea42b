"""Structured output: which constrained-decoding library computes lily's per-token mask.

llguidance and xgrammar are the two that llama.cpp, vLLM and SGLang support. Both compile a
JSON Schema (or regex / grammar) against a tokenizer and, at each decoding step, fill a bitmask
of the tokens that keep the output valid; lily's sampler takes that bitmask
(``Sampler.set_allowed_tokens``). This script measures, for each library and tokenizer:

- setup: building the library's tokenizer index (once per model),
- compile: turning the schema into a matcher (once per request; the libraries cache grammars,
  this is the first-time cost),
- mask: computing the bitmask for one step (every generated token), walked along the tokens of
  a valid document, consuming each token after its mask;
- the same along a strict tool's turn under tool_choice "auto" (lily.structured.tool_call_grammar:
  free text, then a call following the tool's schema), llguidance only;
- lily's tokenizer index (lily.structured._index, the first constrained request's cost): from
  the token bytes (what lily does for byte-level BPE) against from tokenizer.json (llguidance's
  own import, what lily did before);
- then lily's own loop on the demo model: milliseconds per decoded token with and without a
  schema (everything structured output adds per token).

Tokenizers: the demo model's (4K tokens) and the Qwen3.5 / Qwen3.6 tokenizer (248K tokens,
built by scripts/make_tokenizer.py), the one real checkpoints use.

    PYTHONPATH=src python benchmarks/structured_output.py [--repeat 3] [--skip-libraries | --only-index]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines", "poetry"],
            "address": {"city": "London", "zip": "W1"}}


def hf_tokenizer(path: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), eos_token="<|im_end|>")


def run_llguidance(tok, text: str, eos: int):
    import llguidance
    import llguidance.hf
    import llguidance.numpy

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=eos)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), log_level=0)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = llguidance.numpy.allocate_token_bitmask(1, len(tok))
    times = []
    for t in tok.encode(text) + [eos]:
        t0 = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t0)
        assert mask[0, t // 32] >> (t % 32) & 1, f"llguidance masked token {t} of the valid document"
        assert matcher.consume_token(t), matcher.get_error()
    return setup, compile_s, times


def run_xgrammar(tok, text: str, eos: int):
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, len(tok))
    times = []
    for t in tok.encode(text) + [eos]:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        assert int(mask[0, t // 32]) >> (t % 32) & 1, f"xgrammar masked token {t} of the valid document"
        assert matcher.accept_token(t)
    return setup, compile_s, times


def tool_turn(repeat: int) -> None:
    """Mask time along a strict tool's turn under tool_choice "auto": text, then a call."""
    import llguidance
    from make_tokenizer import ensure_tokenizer

    from lily.model import demo_model_path
    from lily.structured import _index, tool_call_grammar
    from lily.tokenizer import Tokenizer

    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "maximum": 7}},
        "required": ["city", "days"]}}}
    text = "The weather in Paris is mild in spring, around fifteen degrees with showers. Let me check.\n\n"
    body = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n" \
           "</function>\n"
    print("\n| tokenizer | strict tool, tool_choice auto | mask per token: median | mean | max | tokens |")
    print("|---|---|---|---|---|---|")
    for tname, path in {"demo (4K)": demo_model_path(), "Qwen3.5/3.6 (248K)": Path(ensure_tokenizer())}.items():
        tok = Tokenizer.from_dir(path)
        index = _index(tok, tok.eos_token_ids)
        grammar = tool_call_grammar(tok, [tool], strict=[True], tool_choice="auto")
        ids = [*tok.encode(text), tok.token_to_id("<tool_call>"), *tok.encode(body), tok.token_to_id("</tool_call>")]
        bits = np.zeros((tok.vocab_size + 31) // 32, np.uint32)
        runs = []
        for _ in range(repeat):
            matcher = llguidance.LLMatcher(index, grammar.text, log_level=0)
            times = []
            for t in ids:
                t0 = time.perf_counter()
                matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
                times.append(time.perf_counter() - t0)
                assert bits[t // 32] >> (t % 32) & 1, f"the grammar masked token {t} of the valid turn"
                assert matcher.consume_token(t), matcher.get_error()
            runs.append(times)
        per_step = np.min(np.array(runs), axis=0)
        print(f"| {tname} | text then a call | {statistics.median(per_step) * 1e6:.0f} us | "
              f"{per_step.mean() * 1e6:.0f} us | {per_step.max() * 1e6:.0f} us | {len(per_step)} |")


def lily_index(repeat: int) -> None:
    """lily.structured._index on a freshly loaded Tokenizer (so Tokenizer.token_bytes is part of
    it), against llguidance's import of the same tokenizer.json, best of ``repeat``."""
    import llguidance
    from make_tokenizer import ensure_tokenizer

    from lily.model import demo_model_path
    from lily.structured import _index
    from lily.tokenizer import Tokenizer

    print("\n| tokenizer | lily's llguidance index from | build (best) | runs |")
    print("|---|---|---|---|")
    for tname, path in {"demo (4K)": demo_model_path(), "Qwen3.5/3.6 (248K)": Path(ensure_tokenizer())}.items():
        best = {"token bytes (lily now)": float("inf"), "tokenizer.json (lily before)": float("inf")}
        for _ in range(repeat):
            for how in best:
                tok = Tokenizer.from_dir(path)
                t0 = time.perf_counter()
                if how.startswith("token bytes"):
                    _index(tok, tok.eos_token_ids)
                else:
                    llguidance.LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids)
                best[how] = min(best[how], time.perf_counter() - t0)
        for how, seconds in best.items():
            print(f"| {tname} | {how} | {seconds * 1e3:.0f} ms | {repeat} |")


def lily_per_token(repeat: int) -> None:
    """Time per generated token in lily's loop on the demo model (CPU backend), with and without
    a JSON Schema: the whole cost of structured output (mask, bitmask copy, masked sampling).
    Runs alternate, and the unconstrained ones have their end-of-sequence tokens banned
    (logit_bias -100) so that both generate about as many tokens."""
    import lily

    model = lily.Model.load()
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    schema = json.loads(json.dumps(SCHEMA).replace('"type": "string"', '"type": "string", "maxLength": 24'))
    no_eos = {t: -100.0 for t in model.eos_token_ids}
    rows: dict[str, dict] = {"unconstrained": {"logit_bias": no_eos}, "json_schema": {"json_schema": schema}}
    per_token: dict[str, list[float]] = {name: [] for name in rows}
    tokens: dict[str, list[int]] = {name: [] for name in rows}
    for seed in range(10 * repeat):
        for name, extra in rows.items():
            r = model.generate(messages, max_tokens=64, temperature=0.8, seed=seed, **extra)
            per_token[name].append(1e3 / r.decode_tokens_per_s)
            tokens[name].append(r.completion_tokens)
    print("\n| lily, demo model, CPU | ms per decoded token (median of runs) | tokens per run (median) |")
    print("|---|---|---|")
    for name in rows:
        print(f"| {name} | {statistics.median(per_token[name]):.2f} | {statistics.median(tokens[name]):.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="runs per library and tokenizer (best kept)")
    ap.add_argument("--skip-libraries", action="store_true", help="only lily's measurements (index, loop)")
    ap.add_argument("--only-index", action="store_true", help="only lily's tokenizer index")
    args = ap.parse_args()
    if not args.skip_libraries and not args.only_index:
        compare_libraries(args.repeat)
        tool_turn(args.repeat)
    lily_index(args.repeat)
    if not args.only_index:
        lily_per_token(args.repeat)


def compare_libraries(repeat: int) -> None:
    from make_tokenizer import ensure_tokenizer

    from lily.model import demo_model_path

    text = json.dumps(DOCUMENT)
    tokenizers = {"demo (4K)": demo_model_path(), "Qwen3.5/3.6 (248K)": Path(ensure_tokenizer())}
    print("| tokenizer | library | setup | compile | mask per token: median | mean | max | tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for tname, path in tokenizers.items():
        tok = hf_tokenizer(path)
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        for lname, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar)):
            try:
                runs = [fn(tok, text, eos) for _ in range(repeat)]
            except ImportError as e:  # xgrammar is not a lily dependency: pip install xgrammar
                print(f"| {tname} | {lname} | not installed ({e.name}) | | | | | |")
                continue
            setup = min(r[0] for r in runs)
            compile_s = min(r[1] for r in runs)
            per_step = np.min(np.array([r[2] for r in runs]), axis=0)  # best of the runs, per step
            print(f"| {tname} | {lname} | {setup * 1e3:.0f} ms | {compile_s * 1e3:.1f} ms | "
                  f"{statistics.median(per_step) * 1e6:.0f} us | {per_step.mean() * 1e6:.0f} us | "
                  f"{per_step.max() * 1e6:.0f} us | {len(per_step)} |")


if __name__ == "__main__":
    main()
