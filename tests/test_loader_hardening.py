"""Hostile checkpoint folders (issue 22, items 11-15): the loaders must fail with a clear error
naming the problem, fast, in bounded memory, and without undefined behaviour in native code.
This file runs in the sanitizer job (scripts/sanitize.sh --ci: ASan + UBSan), which is what
turns a signed overflow or an out-of-bounds allocation in csrc/model into a failure.

Each test changes a private copy of the shipped demo checkpoint in one way. Where the old code
hung (a FIFO) or allocated gigabytes (a config claiming 10^6 layers), the load runs in a child
process with a time limit, and its peak memory is read from the child's rusage.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lily
from lily.checkpoint import safetensors_files
from lily.config import MAX_LAYERS, load_config

DEMO = Path(lily.__file__).resolve().parent / "demo"


@pytest.fixture
def demo(tmp_path) -> Path:
    d = tmp_path / "demo"
    shutil.copytree(DEMO, d)
    return d


def _edit_config(d: Path, **text_config) -> None:
    raw = json.loads((d / "config.json").read_text())
    raw["text_config"].update(text_config)
    if "num_hidden_layers" in text_config:
        raw["text_config"].pop("layer_types", None)  # the interval form: any layer count
    (d / "config.json").write_text(json.dumps(raw))


_CHILD = r"""
import json, resource, sys
import lily
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    lily.Model.load(sys.argv[1])
    out = "loaded"
except BaseException as e:
    out = f"{type(e).__name__}: {e}"[:400]
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
print(json.dumps([out, grew]))
"""


def _load_in_child(d: Path, timeout: float = 60) -> tuple[str, int]:
    """(outcome, bytes the peak RSS grew by during Model.load) in a fresh process; the child is
    killed after `timeout` seconds (the old loader hung forever on a FIFO)."""
    env = dict(os.environ, PYTHONPATH=str(Path(lily.__file__).resolve().parents[1]) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run([sys.executable, "-c", _CHILD, str(d)], capture_output=True, text=True, timeout=timeout,
                           env=env)
    except subprocess.TimeoutExpired:
        return "timeout", -1
    if p.returncode != 0:
        return f"crashed ({p.returncode}): {p.stderr[-800:]}", -1
    out, grew = json.loads(p.stdout.strip().splitlines()[-1])
    return out, grew


# -- item 11: a config claiming more layers than the checkpoint holds ----------------------------

@pytest.mark.parametrize("layers,error", [
    (10**6, "ConfigError"),            # past lily's layer limit: refused before any per-layer work
    (2**31 - 1, "ConfigError"),
    (MAX_LAYERS, "CheckpointError"),   # within it: refused by the tensor table, before allocating
    (9, "CheckpointError"),
])
def test_config_claiming_layers_the_checkpoint_lacks(demo, layers, error):
    """10^6 layers allocated 2.25 GB (per claimed layer, natively) before the missing tensors
    were noticed; 2^31 layers failed with bad_alloc."""
    _edit_config(demo, num_hidden_layers=layers)
    out, grew = _load_in_child(demo)
    assert out.startswith(error) and "layers" in out, out
    assert grew < 200 << 20, f"load grew the peak RSS by {grew >> 20} MiB before failing"


def _native_config(layers: int, **fields):
    c = load_config(DEMO).to_native()
    c.layer_types = ["linear_attention"] * layers
    c.ffn_types = ["moe"] * layers
    for k, v in fields.items():
        setattr(c, k, v)
    return c


_NATIVE_CHILD = r"""
import json, resource, sys
import numpy as np
import lily
from lily.config import load_config
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
cfg = load_config(sys.argv[1])
hidden = cfg.hidden_size  # the demo's width
c = cfg.to_native()
layers, experts = int(sys.argv[2]), int(sys.argv[3])
c.layer_types = ["linear_attention"] * layers
c.ffn_types = ["moe"] * layers
c.n_experts, c.top_k = experts, 1
steps = []
try:
    b = lily._core.WeightsBuilder(c)
    steps.append("built")
    f = b.add_file(sys.argv[1] + "/model.safetensors")
    b.set_vector(f"layers.{layers - 1}.input_norm", np.zeros(hidden, np.float32))
    steps.append("bound the last layer")
    emb = "language_model.model.embed_tokens"
    b.set_affine("embed", f, emb + ".weight", f, emb + ".scales", f, emb + ".biases", 4, 64)
    head = "language_model.lm_head"
    b.set_affine("lm_head", f, head + ".weight", f, head + ".scales", f, head + ".biases", 4, 64)
    b.set_vector("final_norm", np.zeros(hidden, np.float32))
    b.finish()
    steps.append("finished")
except BaseException as e:
    steps.append(f"{type(e).__name__}: {e}"[:300])
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
print(json.dumps([steps, grew]))
"""


def _native_in_child(layers: int, experts: int) -> tuple[list[str], int]:
    env = dict(os.environ, PYTHONPATH=str(Path(lily.__file__).resolve().parents[1]) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _NATIVE_CHILD, str(DEMO), str(layers), str(experts)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    steps, grew = json.loads(p.stdout.strip().splitlines()[-1])
    return steps, grew


def test_native_builder_allocates_only_the_layers_it_binds():
    """The native builder made every claimed layer's weights when constructed (2.25 GB for 10^6
    layers, before a tensor was seen), and finish() listed every slot of every layer before
    checking one. Now a layer exists once a slot of it is bound, and finish() stops at the
    first layer without tensors."""
    steps, grew = _native_in_child(10**6, 8)
    assert steps[:2] == ["built", "bound the last layer"], steps
    assert steps[2].startswith("CheckpointError") and "'layers.0.input_norm'" in steps[2], steps
    assert grew < 200 << 20, f"the builder grew the peak RSS by {grew >> 20} MiB"


def test_native_builder_refuses_experts_the_files_cannot_hold():
    """2^31 - 1 experts per MoE layer: the builder reserved an entry per expert of every layer up
    front (bad_alloc). Now the first slot bound in an MoE layer checks that the files could hold
    that many experts at all."""
    steps, grew = _native_in_child(2, 2**31 - 1)
    assert steps[0] == "built", steps
    assert steps[1].startswith("CheckpointError") and "experts" in steps[1], steps
    assert grew < 200 << 20, f"the builder grew the peak RSS by {grew >> 20} MiB"


# -- item 12: JSON nested 100k deep, or with numbers Python cannot convert -----------------------

@pytest.mark.parametrize("name,error", [
    ("config.json", lily.ConfigError),
    ("generation_config.json", ValueError),
    ("tokenizer_config.json", ValueError),
    ("model.safetensors.index.json", lily.CheckpointError),
])
@pytest.mark.parametrize("doc", ["[" * 100_000 + "]" * 100_000, '{"a": ' + "1" * 5000 + "}"],
                         ids=["nested-100k", "int-5000-digits"])
def test_unparseable_json_files_are_clean_errors(demo, name, error, doc):
    """A config nested 100k deep raised RecursionError (not ConfigError); an integer of 5,000
    digits raised Python's ValueError from inside json without naming the file."""
    (demo / name).write_text(doc)
    with pytest.raises(error, match=name.replace(".", r"\.")):
        lily.Model.load(demo)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(doc=st.one_of(
    st.binary(max_size=200),
    st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=20), inner, max_size=4),
                 max_leaves=20).map(lambda v: json.dumps(v).encode()),
    st.integers(1, 200_000).map(lambda n: b"[" * n + b"]" * n)))
def test_any_config_json_is_a_config_error_or_loads(tmp_path_factory, doc):
    """Property: load_config of any bytes is a ModelConfig or a ConfigError, nothing else."""
    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_bytes(doc)
    try:
        load_config(d)
    except lily.ConfigError:
        pass


# -- item 13: a FIFO (or other non-regular file) where a file should be --------------------------

@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "generation_config.json",
                                  "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_fifo_in_the_model_folder_fails_at_once(demo, name):
    """A FIFO named model.safetensors hung Model.load forever (open() waits for a writer), deaf
    to Ctrl-C."""
    (demo / name).unlink()
    os.mkfifo(demo / name)
    out, _ = _load_in_child(demo, timeout=30)
    assert out != "timeout", f"Model.load blocked on a FIFO named {name}"
    assert "Error" in out and name in out and "FIFO" in out, out


_OPEN_CHILD = r"""
import sys
import lily
from lily.config import load_config
b = lily._core.WeightsBuilder(load_config(sys.argv[1]).to_native())
for path in sys.argv[2:]:
    try:
        b.add_file(path)
        print("opened")
    except lily.CheckpointError as e:
        print(e)
"""


def test_native_open_of_a_fifo_or_directory_fails_at_once(tmp_path):
    """The native loader itself (under the Python checks) opens without blocking and refuses
    anything but a regular file. In a child with a time limit: the old open() never returned."""
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    env = dict(os.environ, PYTHONPATH=str(Path(lily.__file__).resolve().parents[1]) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run([sys.executable, "-c", _OPEN_CHILD, str(DEMO), str(fifo), str(tmp_path)],
                           capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("opening a FIFO blocked")
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert "FIFO" in lines[0] and "directory" in lines[1], lines


# -- item 14: symlink loops, and sizes whose product overflows ----------------------------------

@pytest.mark.parametrize("name,error", [("model.safetensors", lily.CheckpointError),
                                        ("config.json", lily.ConfigError)])
def test_symlink_loop_is_a_clear_error(demo, name, error):
    """A symlink loop gave a raw OSError ([Errno 40] Too many levels of symbolic links)."""
    (demo / name).unlink()
    os.symlink(name, demo / name)
    with pytest.raises(error, match="symbolic link loop"):
        lily.Model.load(demo)


def test_symlink_loop_named_by_the_index(demo):
    (demo / "loop.safetensors").symlink_to("loop.safetensors")
    (demo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "loop.safetensors"}}))
    with pytest.raises(lily.CheckpointError, match="symbolic link loop"):
        lily.Model.load(demo)


@pytest.mark.parametrize("fields,what", [
    ({"head_dim": 10**9}, "q_proj rows"),
    ({"head_dim": 2**30, "num_attention_heads": 2, "num_key_value_heads": 1}, "q_proj rows"),
    ({"linear_key_head_dim": 2**30, "linear_num_key_heads": 2}, "in_proj_qkv"),
    ({"linear_value_head_dim": 2**29, "linear_num_value_heads": 4}, "in_proj_qkv"),
    ({"linear_key_head_dim": 2**28, "linear_conv_kernel_dim": 16}, "conv1d taps"),
])
def test_size_products_past_an_int_are_config_errors(demo, fields, what):
    """head_dim 1e9 made 2 x n_heads x head_dim overflow a signed 32-bit product in native code
    (undefined behaviour; it surfaced as a [-294967296, 256] matrix). Every derived size is now
    computed in 64 bits and checked."""
    _edit_config(demo, **fields)
    with pytest.raises(lily.ConfigError, match=what):
        lily.Model.load(demo)


_DIMS = ["hidden", "n_heads", "n_kv_heads", "head_dim", "gdn_k_heads", "gdn_v_heads", "gdn_k_dim", "gdn_v_dim",
         "conv_kernel", "intermediate", "n_experts", "top_k", "moe_intermediate", "shared_intermediate", "vocab"]


@settings(max_examples=300, deadline=None)
@given(values=st.dictionaries(st.sampled_from(_DIMS), st.integers(-(2**31), 2**31 - 1)
                              | st.sampled_from([2**30, 2**31 - 1, 46341, 65536, 3]), min_size=1, max_size=6),
       fused=st.booleans())
def test_native_size_arithmetic_property(values, fused):
    """Property (under UBSan in the sanitizer job): any dimensions in the native config either
    validate or raise ConfigError, and every slot of a validated config resolves without signed
    overflow (each is offered a vector, which the builder refuses by size or binds)."""
    c = _native_config(2)
    c.layer_types = ["linear_attention", "full_attention"]
    c.ffn_types = ["moe", "dense"]
    c.gdn_fused_qkvz = fused
    for k, v in values.items():
        setattr(c, k, v)
    try:
        c.validate()
    except lily.ConfigError:
        return
    b = lily._core.WeightsBuilder(c)
    slots = ["embed", "final_norm", "layers.0.gdn.conv1d", "layers.0.gdn.in_qkv", "layers.0.gdn.in_qkvz",
             "layers.0.gdn.in_ba", "layers.1.attn.q_proj", "layers.1.attn.k_proj", "layers.1.attn.o_proj",
             "layers.1.attn.q_norm", "layers.1.mlp.gate", "layers.0.moe.experts.0.down"]
    for slot in slots:
        try:
            b.set_vector(slot, np.zeros(3, np.float32))
        except (lily.LilyError, ValueError):
            pass


# -- item 15: index.json naming files outside the model folder ----------------------------------

@pytest.mark.parametrize("shard", ["/etc/passwd", "../../../../../../etc/passwd", "sub/../../outside.safetensors",
                                   "..", "", "/", "a\\..\\..\\b"])
def test_index_cannot_name_files_outside_the_folder(demo, shard):
    """model.safetensors.index.json naming /etc/passwd made the loader open it, and its error
    echoed the file's first bytes."""
    outside = demo.parent / "outside.safetensors"
    shutil.copy(demo / "model.safetensors", outside)
    (demo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model.safetensors",
                                                                                  "b": shard}}))
    with pytest.raises(lily.CheckpointError) as info:
        lily.Model.load(demo)
    msg = str(info.value)
    assert "outside the model folder" in msg or "not a file name" in msg, msg
    assert "root:" not in msg


def test_index_naming_shards_inside_the_folder_still_loads(demo):
    (demo / "shards").mkdir()
    os.rename(demo / "model.safetensors", demo / "shards" / "model-00001-of-00001.safetensors")
    builder = lily._core.WeightsBuilder(load_config(DEMO).to_native())
    f = builder.add_file(str(demo / "shards" / "model-00001-of-00001.safetensors"))
    weight_map = {n: "shards/./model-00001-of-00001.safetensors" for n, _, _ in builder.tensors(f)}
    (demo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert [p.name for p in safetensors_files(demo)] == ["model-00001-of-00001.safetensors"]
    ref = lily.Model.load().generate("The json module", max_tokens=4, temperature=0)
    assert lily.Model.load(demo).generate("The json module", max_tokens=4, temperature=0).tokens == ref.tokens


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.sampled_from(["..", ".", "a", "b", "", "model.safetensors", "/", "..."]), min_size=1,
                      max_size=6))
def test_shard_names_resolve_inside_the_folder_property(tmp_path_factory, parts):
    """Property: for any shard name, safetensors_files either refuses it or returns a path that
    resolves inside the model folder."""
    root = tmp_path_factory.mktemp("m")
    d = root / "x" / "y"
    (d / "a" / "b").mkdir(parents=True)
    for where in (d, d / "a", d / "a" / "b", root, root / "x"):
        (where / "model.safetensors").write_bytes(b"")
    name = "/".join(parts)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"t": name}}))
    try:
        files = safetensors_files(d)
    except lily.CheckpointError:
        return
    for f in files:
        assert os.path.realpath(f).startswith(os.path.realpath(d) + os.sep), (name, f)

