"""Writes the seed corpora of the fuzz targets (deterministic; the output is committed).

  python tests/fuzz/make_seeds.py

corpus/safetensors: valid files for the tiny config of safetensors_fuzz.cpp (every slot dense
in F32/F16/BF16, an MLX-style affine variant, stacked experts) plus edge cases (empty header,
metadata only, zero-size tensors). corpus/json: the demo model's config files and headers.
corpus/config, corpus/tokenizer, corpus/template: the Python targets' seeds.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
from safetensors.numpy import save

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
DEMO = HERE.parents[1] / "src" / "lily" / "demo"

# The tiny config of safetensors_fuzz.cpp: hidden 64, vocab 16, GDN (k 1x32, v 2x32, conv 4) +
# MoE (2 experts of 32, shared 32) in layer 0, attention (2 heads, 1 kv, dim 32) + MLP 64 in 1.
H, V = 64, 16
MATRICES = {
    "embed": (V, H), "lm_head": (V, H),
    "layers.0.gdn.in_qkv": (128, H), "layers.0.gdn.in_z": (64, H), "layers.0.gdn.in_b": (2, H),
    "layers.0.gdn.in_a": (2, H), "layers.0.gdn.out_proj": (H, 64), "layers.0.moe.router": (2, H),
    "layers.0.moe.shared_gate": (1, H), "layers.0.moe.shared.gate": (32, H),
    "layers.0.moe.shared.up": (32, H), "layers.0.moe.shared.down": (H, 32),
    **{f"layers.0.moe.experts.{e}.{p}": ((32, H) if p != "down" else (H, 32))
       for e in range(2) for p in ("gate", "up", "down")},
    "layers.1.attn.q_proj": (128, H), "layers.1.attn.k_proj": (32, H), "layers.1.attn.v_proj": (32, H),
    "layers.1.attn.o_proj": (H, 64), "layers.1.mlp.gate": (64, H), "layers.1.mlp.up": (64, H),
    "layers.1.mlp.down": (H, 64),
}


def _raw(header: dict, data: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def safetensors_seeds() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    seeds = {}
    for dt in (np.float16,):
        seeds[f"dense_{np.dtype(dt).name}"] = save(
            {k: rng.standard_normal(s).astype(dt) for k, s in MATRICES.items()}, metadata={"format": "pt"})
    # Affine (MLX layout): packed uint32 [out, in*bits/32], scales/biases [out, in/group].
    aff = {}
    for k, (o, i) in MATRICES.items():
        bits, group = (8, 32) if "router" in k else (4, 32)
        aff[k] = rng.integers(0, 2**32, size=(o, i * bits // 32), dtype=np.uint32)
        aff[k + ".scales"] = rng.standard_normal((o, i // group)).astype(np.float16)
        aff[k + ".biases"] = rng.standard_normal((o, i // group)).astype(np.float16)
    seeds["affine_4bit"] = save(aff)
    # Stacked experts [E, rows, cols] under names that are not slots (bound by hash).
    seeds["stacked"] = save({
        "experts.gate_up_proj": rng.standard_normal((2, 64, H)).astype(np.float16),
        "experts.down_proj": rng.standard_normal((2, H, 32)).astype(np.float16),
        "experts.packed": rng.integers(0, 2**32, size=(2, 32, 8), dtype=np.uint32),
        "experts.packed.scales": rng.standard_normal((2, 32, 2)).astype(np.float16),
        "experts.packed.biases": rng.standard_normal((2, 32, 2)).astype(np.float16),
    })
    seeds["empty_header"] = _raw({})
    seeds["metadata_only"] = _raw({"__metadata__": {"format": "pt"}})
    seeds["zero_size"] = _raw({"a": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]},
                               "b": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4)
    seeds["all_dtypes"] = _raw({
        n: {"dtype": n, "shape": [1], "data_offsets": [8 * i, 8 * i + sz]}
        for i, (n, sz) in enumerate([("F64", 8), ("F32", 4), ("F16", 2), ("BF16", 2), ("I64", 8), ("I32", 4),
                                     ("I16", 2), ("I8", 1), ("U64", 8), ("U32", 4), ("U16", 2), ("U8", 1),
                                     ("BOOL", 1)])}, b"\1" * 8 * 13)
    return seeds


def main() -> None:
    if CORPUS.exists():
        shutil.rmtree(CORPUS)
    st = safetensors_seeds()
    for name, blob in st.items():
        _write("safetensors", name, blob)
    # JSON: the demo model's documents, and every safetensors seed's header.
    for f in ("config.json", "generation_config.json", "tokenizer_config.json"):
        _write("json", f, (DEMO / f).read_bytes())
    for name, blob in st.items():
        (n,) = struct.unpack("<Q", blob[:8])
        _write("json", f"header_{name}", blob[8:8 + n])
    _write("json", "nested", b'{"a": [1, -2.5e3, true, false, null, "\\u00e9\\ud83d\\ude00"], "b": {}}')
    # Python config target: config.json + generation_config.json of the demo and variants.
    cfg = json.loads((DEMO / "config.json").read_text())
    gen = (DEMO / "generation_config.json").read_bytes()
    # The Python targets' first byte picks the mode: even = raw documents, odd = structured
    # edits of the target's seed document driven by the remaining bytes.
    _write("config", "demo", b"\0" + _pair(json.dumps(cfg).encode(), gen))
    plain = {k: v for k, v in cfg.items() if k != "quantization"}
    _write("config", "unquantized", b"\0" + _pair(json.dumps(plain).encode(), b"{}"))
    text = cfg.get("text_config", cfg)
    nested = {"model_type": "qwen3_5_moe", "text_config": text, "quantization_config": {"bits": 8, "group_size": 32}}
    _write("config", "nested_hf", b"\0" + _pair(json.dumps(nested).encode(), b'{"temperature": 0.7, "top_p": 0.9}'))
    # Tokenizer target: tokenizer.json + tokenizer_config.json of the demo.
    _write("tokenizer", "demo", b"\0" + _pair((DEMO / "tokenizer.json").read_bytes(),
                                      (DEMO / "tokenizer_config.json").read_bytes()))
    _write("config", "structured", b"\1" + bytes(range(64)))
    _write("tokenizer", "structured", b"\1" + bytes(range(64)))
    # Server target: first byte picks the route (even: chat, odd: completions), then the mode.
    chat = {"model": "lily-demo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    _write("server", "chat", b"\0\0" + json.dumps(chat).encode())
    _write("server", "completions", b"\1\0" + json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode())
    _write("server", "chat_structured", b"\0\1" + bytes(range(64)))
    _write("server", "completions_structured", b"\1\1" + bytes(range(64, 128)))
    # Regression inputs: what the fuzzers crashed on before the fixes (docs/reliability.md).
    big = json.loads(json.dumps(cfg))
    big.get("text_config", big)["vocab_size"] = 2**31
    _write("config", "regress_vocab_2_31", b"\0" + _pair(json.dumps(big).encode(), b"{}"))
    q = json.loads(json.dumps(cfg))
    q["quantization"]["bits"] = 2**40
    _write("config", "regress_bits_2_40", b"\0" + _pair(json.dumps(q).encode(), b"{}"))
    mt = json.loads(json.dumps(cfg))
    mt["model_type"] = {"a": 1}
    _write("config", "regress_model_type_dict", b"\0" + _pair(json.dumps(mt).encode(), b"{}"))
    _write("server", "regress_surrogate_model", b"\0\0" + b'{"model": "\\ud800", "messages": []}')
    _write("server", "regress_surrogate_prompt", b"\1\0" + b'{"prompt": "x\\ud83d", "max_tokens": 1}')
    header = {"a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
              "empty": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}
    _write("safetensors", "regress_hidden_overlap", _raw(header, bytes(64)))
    # Template target: the demo template and a few small ones.
    _write("template", "demo", (DEMO / "chat_template.jinja").read_bytes())
    _write("template", "loop", b"{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    _write("template", "macro", b"{% macro f(x) %}{{ x }}{% endmacro %}{{ f(messages[0].content) | upper }}")
    _write("template", "ns", b"{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                             b"{% endfor %}{{ ns.n }}{{ tools | tojson }}")

    # Issue 22 (the adversarial review, docs/reliability.md): one input per finding.
    ok_chat = {"model": "lily-demo", "messages": [{"role": "user", "content": "Hi"}]}
    _write("server", "regress22_int_5000_digits", b"\0\0" + json.dumps(ok_chat)[:-1].encode()
           + b', "max_tokens": ' + b"1" * 5000 + b"}")
    _write("server", "regress22_nan", b"\1\0" + b'{"prompt": "x", "temperature": NaN}')
    _write("server", "regress22_top_k_1e12", b"\1\0" + json.dumps({"prompt": "x", "top_k": 10**12}).encode())
    bad_tool = {**ok_chat, "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 5}}}}}]}
    _write("server", "regress22_tool_type_5", b"\0\0" + json.dumps(bad_tool).encode())
    _write("server", "regress22_required_no_tools", b"\0\0" + json.dumps({**ok_chat, "tool_choice": "required"}).encode())
    _write("config", "regress22_nested_100k", b"\0" + _pair(b"[" * 100_000 + b"]" * 100_000, b"{}"))
    for field, value in (("num_hidden_layers", 10**6), ("head_dim", 10**9)):
        c = json.loads(json.dumps(cfg))
        c["text_config"][field] = value
        c["text_config"].pop("layer_types", None)
        _write("config", f"regress22_{field}", b"\0" + _pair(json.dumps(c).encode(), b"{}"))
    _write("template", "regress22_concat_doubling",
           b"{% set ns = namespace(x='ab') %}{% for i in range(64) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}")
    _write("template", "regress22_replace_growth",
           b"{% set ns = namespace(x='a') %}{% for i in range(64) %}{% set ns.x = ns.x.replace('a', 'aa') %}"
           b"{% endfor %}")
    _write("template", "regress22_join_references", b"{{ (['x' * 100000] * 100000) | join }}")
    _write("template", "regress22_set_block",
           b"{% set s = 'x' * 100000 %}{% set out %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}")


def _pair(a: bytes, b: bytes) -> bytes:
    """Two documents in one input: a 4-byte little-endian length of the first, then both."""
    return struct.pack("<I", len(a)) + a + b


def _write(target: str, name: str, blob: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(blob)


if __name__ == "__main__":
    main()
