"""`lily convert`: Hugging Face checkpoint -> MLX-format quantized checkpoint (affine, or the
mxfp4 / mxfp8 / nvfp4 modes).

The output is what ``mlx_lm.convert -q [--q-mode MODE]`` writes for this family, tensor for tensor and byte for
byte, produced with NumPy alone (no MLX needed, so it also runs where MLX does not):

1. re-layout (mlx_lm's ``sanitize``): drop vision / MTP tensors (also where a re-saved derivative
   nests them under the language model, ``model.language_model.{visual,mtp}.*``); rename the Qwen3.5 prefixes
   (``model.language_model.`` -> ``language_model.model.``, others get ``language_model.``);
   experts into ``switch_mlp.{gate,up,down}_proj`` stacks [E, out, in] (from the fused
   ``gate_up_proj`` or from per-expert tensors); conv1d [C, 1, K] -> [C, K, 1]; zero-centred
   RMSNorm weights + 1 (input/post-attention layernorm, final norm, q/k norm; not the gated
   DeltaNet norm), all done in the tensor's own dtype;
2. dtype cast, as mlx_lm decides it: ``torch_dtype`` of config.json, else ``text_config.dtype``
   (or ``--dtype``); ``A_log`` keeps its dtype on Qwen3.5;
3. affine quantization of every Linear / Embedding / SwitchLinear weight whose input dim is a
   multiple of the group size; the MoE router ``mlp.gate`` and ``mlp.shared_expert_gate`` at
   8 bits, group 64 (mlx_lm's quant_predicate for MoE models), recorded per layer in config.
   With ``mode`` mxfp4 / mxfp8 / nvfp4 the same weights take that mode instead (uint8 scales, no
   biases; quantize_microscaled), the routers staying affine 8-bit as mlx_lm leaves them.

The quantizer reproduces MLX's affine rule exactly, in float32 like MLX's CPU kernel: per group
of ``group_size`` inputs, with n = 2^bits - 1,
    scale = max((max - min) / n, 1e-7), negated unless |min| > |max|; edge = min or max to match;
    q0 = rint(edge / scale); if q0 != 0: scale = edge / q0, bias = edge, else bias = 0;
    q = clip(rint((w - bias) / scale), 0, n);
scale and bias are stored in the weight's dtype (bf16 rounding to nearest even), q packed as one
little-endian bit stream per row into uint32 words.

Memory: tensors are read through memory maps and written in shards of at most 5 GiB (mlx_lm's
limit), so a conversion holds about one shard in memory.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from lily._core import CheckpointError, ConfigError
from lily.checkpoint import is_unused_part

MAX_SHARD_BYTES = 5 << 30
SUPPORTED = ("qwen3_5_moe", "qwen3_5", "qwen3_next")
_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
          ".q_norm.weight", ".k_norm.weight")
_COPY = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
         "chat_template.json", "generation_config.json", "vocab.json", "merges.txt")

# -- bfloat16 in NumPy (stored as uint16) -------------------------------------------------------


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as MLX / Eigen / torch do; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


class Array:
    """A tensor as stored: raw values (bf16 as uint16) plus its dtype name."""

    __slots__ = ("data", "dtype")

    def __init__(self, data: np.ndarray, dtype: str):
        self.data, self.dtype = data, dtype

    @property
    def shape(self):
        return self.data.shape

    def f32(self) -> np.ndarray:
        if self.dtype == "BF16":
            return bf16_to_f32(self.data)
        return np.asarray(self.data, dtype=np.float32)

    @staticmethod
    def from_f32(x: np.ndarray, dtype: str) -> Array:
        if dtype == "BF16":
            return Array(f32_to_bf16(x), "BF16")
        np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]
        return Array(np.asarray(x).astype(np_dtype), dtype)


# -- safetensors (the format is a JSON header and raw little-endian data) ------------------------

_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "I32": np.int32,
       "I64": np.int64, "U8": np.uint8, "I8": np.int8, "F64": np.float64, "BOOL": np.bool_,
       "F8_E4M3": np.uint8}


def read_safetensors(path: Path) -> dict[str, Array]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"[convert] {path} has a malformed safetensors header ({e})") from None
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _NP:
            raise CheckpointError(f"[convert] tensor '{name}' in {path.name} has unsupported dtype {dt}")
        a, b = info["data_offsets"]
        raw = mm[8 + n + a : 8 + n + b]
        out[name] = Array(raw.view(_NP[dt]).reshape(info["shape"]), dt)
    return out


def write_safetensors(path: Path, tensors: dict[str, Array], metadata: dict[str, str]) -> None:
    header: dict = {"__metadata__": metadata}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        nbytes = t.data.nbytes
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name].data).tobytes())


# -- FP8 checkpoints (Qwen's official FP8 releases) -------------------------------------------------


def _e4m3_table() -> np.ndarray:
    """float8_e4m3fn (OCP FP8, "fn": no infinities) byte -> float32: 1 sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent 0 is subnormal (m/8 * 2^-6); 0x7F / 0xFF are NaN."""
    b = np.arange(256, dtype=np.uint32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, (b & 0x7).astype(np.float64)
    value = np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0 ** (exp.astype(np.float64) - 7))
    value = np.where((b & 0x7F) == 0x7F, np.nan, sign * value)
    return value.astype(np.float32)


_E4M3 = _e4m3_table()


class Fp8Weight(Array):
    """An F8_E4M3 weight times its ``weight_scale_inv`` (one float per block[0] x block[1] tile,
    edge tiles partial; despite the name a multiplier, as transformers' finegrained_fp8
    dequantizes it), as float32 computed each time it is read: the conversion streams tensor by
    tensor, and a whole 35B model in float32 would not fit in memory."""

    __slots__ = ("q", "scale", "block")

    def __init__(self, q: np.ndarray, scale: Array, block: tuple[int, int]):
        self.q, self.scale, self.block, self.dtype = q, scale, block, "F32"

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        *_, rows, cols = self.q.shape
        tiles = np.repeat(np.repeat(self.scale.f32(), self.block[0], axis=-2), self.block[1], axis=-1)
        return _E4M3[self.q] * tiles[..., :rows, :cols]  # [..., rows, cols] float32

    @property
    def shape(self):
        return self.q.shape


def dequantize_fp8(tensors: dict[str, Array], block: tuple[int, int]) -> dict[str, Array]:
    """FP8 weights and their block scales -> float32 weights (read lazily, see Fp8Weight)."""
    out: dict[str, Array] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale_inv"):
            if name[: -len("_scale_inv")] not in tensors:
                raise CheckpointError(f"[convert] '{name}' has no FP8 weight '{name[: -len('_scale_inv')]}'")
            continue
        if t.dtype != "F8_E4M3":
            out[name] = t
            continue
        scale_name = name + "_scale_inv"
        if scale_name not in tensors:
            raise CheckpointError(f"[convert] FP8 tensor '{name}' has no '{scale_name}' block scales")
        s = tensors[scale_name]
        *lead, rows, cols = t.shape
        grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
        if tuple(s.shape) != grid:
            raise CheckpointError(f"[convert] '{scale_name}' has shape {list(s.shape)}, expected {list(grid)} for "
                                  f"{list(t.shape)} in {block[0]}x{block[1]} blocks")
        out[name] = Fp8Weight(t.data, s, block)
    return out


def _fp8_block(config: dict) -> tuple[int, int] | None:
    """The block shape of an FP8 checkpoint's scales; None for other checkpoints."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "fp8":
        return None
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"[convert] FP8 format {fmt!r} is not supported (only e4m3)")
    block = q.get("weight_block_size") or [128, 128]
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"[convert] quantization_config weight_block_size {block!r} is not two positive integers")
    return block[0], block[1]


# -- MLX affine quantization ---------------------------------------------------------------------


def quantize(w: np.ndarray, bits: int, group_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w float32 [..., cols] -> (packed uint32 [..., cols*bits/32], scales f32, biases f32 [..., cols/gs])."""
    *lead, cols = w.shape
    if cols % group_size:
        raise ValueError(f"[quantize] last dim {cols} is not a multiple of the group size {group_size}")
    f32 = np.float32
    g = np.ascontiguousarray(w, dtype=f32).reshape(-1, group_size)  # [groups, gs]
    n_bins = f32((1 << bits) - 1)
    wmax = g.max(axis=1)
    wmin = g.min(axis=1)
    mask = np.abs(wmin) > np.abs(wmax)
    scale = np.maximum((wmax - wmin) / n_bins, f32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, wmin, wmax)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nz, edge / np.where(nz, q0, f32(1)), scale).astype(f32)
    bias = np.where(nz, edge, f32(0)).astype(f32)
    q = np.rint((g - bias[:, None]) / scale[:, None])
    q = np.clip(q, f32(0), n_bins).astype(np.uint8)  # [groups, gs]
    # One little-endian bit stream per row: element j at bits [j*bits, (j+1)*bits).
    rows = int(np.prod(lead)) if lead else 1
    bitplanes = np.unpackbits(q.reshape(rows, cols, 1), axis=2, bitorder="little")[:, :, :bits]
    packed = np.packbits(bitplanes.reshape(rows, cols * bits), axis=1, bitorder="little")
    packed = packed.view(np.uint32).reshape(*lead, cols * bits // 32)
    groups = (*lead, cols // group_size)
    return packed, scale.reshape(groups), bias.reshape(groups)


# -- MLX microscaled quantization (mxfp4, mxfp8, nvfp4) ------------------------------------------

#: mode -> (bits, group size): each MLX floating-point mode fixes both (mlx.core.quantize).
MICROSCALED = {"mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                 dtype=np.float32)


def _round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to the grid of `dtype` (kept as float32): what an MLX op in that
    dtype returns (it computes in float32 and rounds once)."""
    if dtype == "BF16":
        return bf16_to_f32(f32_to_bf16(x))
    if dtype == "F16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    return np.asarray(x, dtype=np.float32)


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> float8 e4m3fn bytes as MLX's to_fp8 converts: round to nearest even,
    saturating at +-448 (so is NaN), subnormals by adding 2^14 in float32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    sign = u & np.uint32(0x80000000)
    u = u ^ sign
    magic = np.uint32(141 << 23)  # 2^14: below 2^-6 the f32 sum rounds x to a multiple of 2^-9
    low = ((u.view(np.float32) + magic.view(np.float32)).view(np.uint32) - magic).astype(np.uint8)
    rebias = np.uint32(((7 - 127) << 23) + 0x7FFFF & 0xFFFFFFFF)  # exponent bias 127 -> 7, round half...
    high = ((u + rebias + ((u >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)).astype(np.uint8)  # ...to even
    out = np.where(u < np.uint32(121 << 23), low, high)
    out = np.where(u >= np.uint32(543 << 21), np.uint8(0x7E), out)  # |x| >= 448: the largest finite
    return out | (sign >> np.uint32(24)).astype(np.uint8)


def quantize_microscaled(w: np.ndarray, mode: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """w [..., cols] (float32 holding values of `dtype`) -> (packed uint32 [..., cols*bits/32],
    scales uint8 [..., cols/group]), as mlx.core.quantize(w, mode=mode) computes it on a `dtype` array:
    per group, scale = max|w| / (6 for e2m1, 448 for e4m3) in `dtype`;
      mx (e8m0 scales): e = ceil(log2(scale)) in float32 (0 for a zero group; rounding up, so
        no element clips), w / 2^e in `dtype`, byte e + 127;
      nvfp4 (e4m3 scales): byte = e4m3(scale), w / scale in `dtype`, then float32;
    codes: e4m3 of the scaled value (mxfp8), or the nearest e2m1 value, ties to the first in
    e2m1 code order (mxfp4, nvfp4; distances in `dtype` for mxfp4, float32 for nvfp4)."""
    bits, gs = MICROSCALED[mode]
    *lead, cols = w.shape
    if cols % gs:
        raise ValueError(f"[quantize] last dim {cols} is not a multiple of {mode}'s group size {gs}")

    def rnd(x):
        return _round_to(x, dtype)

    g = np.ascontiguousarray(w, dtype=np.float32).reshape(-1, gs)  # [groups, gs]
    scale = rnd(np.abs(g).max(axis=1, keepdims=True) / np.float32(6.0 if bits == 4 else 448.0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if mode == "nvfp4":
            sbytes = to_e4m3(scale)
            scaled = rnd(g / rnd(_E4M3[sbytes]))
            arith = np.asarray  # the e4m3 scale's encode factor (1.0, float32) promotes to float32
        else:
            e = np.where(scale == 0, np.float32(0), np.ceil(np.log2(scale))).astype(np.int32)
            scaled = rnd(g / rnd(np.ldexp(np.float32(1.0), e)))
            sbytes = (e + 127).astype(np.uint8)
            arith = rnd
        if bits == 8:
            packed = to_e4m3(scaled).reshape(-1).view(np.uint32)
        else:
            codes = np.argmin(np.abs(arith(scaled[..., None] - _E2M1)), axis=-1).astype(np.uint32)
            packed = (codes.reshape(-1, 8) << (4 * np.arange(8, dtype=np.uint32))).sum(axis=1, dtype=np.uint32)
    return packed.reshape(*lead, cols * bits // 32), sbytes.reshape(*lead, cols // gs)


# -- the conversion --------------------------------------------------------------------------


def _load_config(src: Path) -> dict:
    try:
        return json.loads((src / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"[convert] {src} has no config.json") from None
    except ValueError as e:
        raise ConfigError(f"[convert] {src / 'config.json'} is not valid JSON ({e})") from None


def _sanitize(model_type: str, tensors: dict[str, Array], text: dict) -> dict[str, Array]:
    """mlx_lm's re-layout for this family (names, expert stacks, conv layout, norm + 1)."""
    out: dict[str, Array] = {}
    if model_type in ("qwen3_5_moe", "qwen3_5"):
        for k, v in tensors.items():
            # mlx_lm drops `vision_tower*`, `model.visual*` and any `mtp.`; re-saved derivatives
            # also nest both under the language model (`model.language_model.visual.*`).
            if is_unused_part(k) or "mtp." in k:
                continue
            if k.startswith("model.language_model"):
                k = k.replace("model.language_model", "language_model.model", 1)
            elif not k.startswith("language_model."):
                k = "language_model." + k
            out[k] = v
        prefix = "language_model.model.layers"
        convert_norms = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in out.items())
    else:  # qwen3_next
        out = {k: v for k, v in tensors.items() if "mtp." not in k and not is_unused_part(k)}
        prefix = "model.layers"
        convert_norms = any(k.endswith(".mlp.experts.0.up_proj.weight") for k in out)
    if text.get("tie_word_embeddings"):
        out.pop("lm_head.weight", None)
        out.pop("language_model.lm_head.weight", None)

    layers = int(text["num_hidden_layers"])
    n_exp = int(text.get("num_experts") or 0)
    for i in range(layers):
        p = f"{prefix}.{i}.mlp"
        if f"{p}.experts.gate_up_proj" in out:
            gu = out.pop(f"{p}.experts.gate_up_proj")
            mid = gu.shape[-2] // 2
            out[f"{p}.switch_mlp.gate_proj.weight"] = Array(np.ascontiguousarray(gu.data[..., :mid, :]), gu.dtype)
            out[f"{p}.switch_mlp.up_proj.weight"] = Array(np.ascontiguousarray(gu.data[..., mid:, :]), gu.dtype)
            out[f"{p}.switch_mlp.down_proj.weight"] = out.pop(f"{p}.experts.down_proj")
        elif n_exp and f"{p}.experts.0.gate_proj.weight" in out:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                parts = [out.pop(f"{p}.experts.{e}.{proj}.weight") for e in range(n_exp)]
                out[f"{p}.switch_mlp.{proj}.weight"] = Array(np.stack([a.data for a in parts]), parts[0].dtype)
    for k in list(out):
        v = out[k]
        if "conv1d.weight" in k and v.shape[-1] != 1:
            v = out[k] = Array(np.ascontiguousarray(np.moveaxis(v.data, 2, 1)), v.dtype)
        if convert_norms and k.endswith(_NORMS) and v.data.ndim == 1:
            out[k] = Array.from_f32(v.f32() + np.float32(1.0), v.dtype)
    return out


def _quant_rule(model_type: str, key: str, shape: tuple, text: dict, bits: int, group_size: int, mode: str):
    """(bits, group_size, mode, per-layer config entry or None) for a quantized weight; None to
    keep it. The MoE routers stay affine 8-bit in every mode (mlx_lm's predicate names no mode)."""
    if not key.endswith(".weight") or len(shape) < 2 or "conv1d" in key:
        return None
    if shape[-1] % group_size:
        return None  # mlx_lm leaves such a layer unquantized
    path = key[: -len(".weight")]
    moe = model_type == "qwen3_next" or int(text.get("num_experts") or 0) > 0
    if moe and (path.endswith("mlp.gate") or path.endswith("shared_expert_gate")):
        return 8, 64, "affine", {"group_size": 64, "bits": 8}
    return bits, group_size, mode, None


def convert(src: str | Path, out: str | Path, *, bits: int | None = None, group_size: int | None = None,
            mode: str = "affine", dtype: str | None = None, quantize_weights: bool = True,
            progress: bool = True) -> Path:
    """Converts the Hugging Face checkpoint ``src`` into an MLX checkpoint folder ``out``.

    ``mode`` is MLX's quantization mode: "affine" (``bits`` 2-8, ``group_size`` 32/64/128;
    default 4 / 64) or "mxfp4" / "mxfp8" / "nvfp4", which fix both (leave them None)."""
    from lily.hub import resolve_model_path

    out = Path(out)
    if out.exists():
        raise FileExistsError(f"[convert] {out} already exists; give a new folder")
    if mode in MICROSCALED:
        want = MICROSCALED[mode]
        if (bits or want[0], group_size or want[1]) != want:
            raise ConfigError(f"[convert] mode {mode!r} quantizes to {want[0]} bits in groups of {want[1]}; "
                              f"got bits={bits} / group_size={group_size} (leave them out)")
        bits, group_size = want
    elif mode != "affine":
        raise ConfigError(f"[convert] unknown quantization mode {mode!r} (affine, {', '.join(MICROSCALED)})")
    bits, group_size = bits or 4, group_size or 64
    if mode == "affine" and (bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128)):
        raise ConfigError(f"[convert] unsupported bits={bits} / group_size={group_size} "
                          "(bits 2, 3, 4, 5, 6, 8; group size 32, 64, 128)")
    src = Path(src) if Path(src).exists() else resolve_model_path(str(src))
    config = _load_config(src)
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ConfigError(f"[convert] model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
    text = config.get("text_config", config)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"[convert] no .safetensors files in {src}")

    tensors: dict[str, Array] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    fp8_block = _fp8_block(config)
    if fp8_block is not None or any(t.dtype == "F8_E4M3" for t in tensors.values()):
        tensors = dequantize_fp8(tensors, fp8_block or (128, 128))
    tensors = _sanitize(model_type, tensors, text)

    if dtype is None:
        dtype = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    target = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(dtype)
    keep_dtype = (lambda k: k.endswith("A_log")) if model_type in ("qwen3_5_moe", "qwen3_5") else (lambda k: False)

    qconfig: dict = {"group_size": group_size, "bits": bits, "mode": mode}
    result: dict[str, Array] = {}
    names = list(tensors)
    shards: list[dict[str, Array]] = [{}]
    shard_bytes = 0
    out.mkdir(parents=True)
    bar = _Progress(len(names), "converting", enabled=progress)
    for idx, k in enumerate(names):
        v = tensors.pop(k)
        if target and v.dtype in ("F32", "BF16", "F16") and v.dtype != target and not keep_dtype(k):
            v = Array.from_f32(v.f32(), target)
        rule = _quant_rule(model_type, k, v.shape, text, bits, group_size, mode) if quantize_weights else None
        if rule is None:
            produced = {k: v}
        else:
            b, gs, m, entry = rule
            base = k[: -len(".weight")]
            if m == "affine":
                packed, s, bias = quantize(v.f32(), b, gs)
                produced = {k: Array(packed, "U32"), base + ".scales": Array.from_f32(s, v.dtype),
                            base + ".biases": Array.from_f32(bias, v.dtype)}
            else:  # byte scales, no biases
                packed, sbytes = quantize_microscaled(v.f32(), m, v.dtype)
                produced = {k: Array(packed, "U32"), base + ".scales": Array(sbytes, "U8")}
            if entry is not None:
                qconfig[base] = entry
        for name, arr in produced.items():
            if shard_bytes and shard_bytes + arr.data.nbytes > MAX_SHARD_BYTES:
                shards.append({})
                shard_bytes = 0
            shards[-1][name] = arr
            shard_bytes += arr.data.nbytes
            result[name] = None  # names only: the data lives in the shard
        bar.update(idx + 1)
    bar.close()

    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / fname, shard, {"format": "mlx"})
        for name, arr in shard.items():
            weight_map[name] = fname
            total += arr.data.nbytes
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=4))

    new_config = dict(config)
    rope = (new_config.get("text_config") or {}).get("rope_parameters")
    if model_type in ("qwen3_5_moe", "qwen3_5") and isinstance(rope, dict) and "rope_type" in rope:
        rope["type"] = rope.pop("rope_type")  # mlx_lm's spelling when it re-saves
    new_config.pop("_name_or_path", None)
    new_config.pop("vision_config", None)
    if fp8_block is not None:
        new_config.pop("quantization_config")  # the FP8 scheme: the weights are no longer FP8
    if quantize_weights:
        new_config["quantization"] = qconfig
        new_config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(dict(sorted(new_config.items())), indent=4))
    for name in _COPY:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


class _Progress:
    """A one-line progress bar on stderr (only when it is a terminal)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label = total, label
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, n: int) -> None:
        if self.enabled:
            width = 30
            filled = int(width * n / max(self.total, 1))
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {n}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
