#!/usr/bin/env bash
# Everything that follows a demo training run, in one go (REGENERATE.md lists what depends on the
# demo's weights and why). Run from anywhere; needs mlx-lm 0.32.2 and transformers 5.24 (as for
# convert.py / evaluate.py), lily importable (the checkout's src/ with its built _core, else the
# installed package), matplotlib for the plot, and data/ of this folder with tokenizer.json and
# val.bin (README.md's corpus commands, or REGENERATE.md's shortcut from the carried payload).
#
#   bash regenerate.sh CKPT_INT8 [WORK]     # stage: measure the candidate, change nothing here
#   INSTALL=1 bash regenerate.sh CKPT_INT8 [WORK]   # then ship it: src/lily/demo, records, seeds
#
# CKPT_INT8: the folder gpu_train.sh wrote ($OUT/ckpt: int8 shards, index, config.json, loss.csv,
# train_summary.json), with the run's stdout beside it as train_log.txt if it came back.
# Staging writes only under WORK (default /tmp/demo_regen): bf16/ (dequantized), mlx/ (the
# candidate package), twin/ (random init, same conversion), demo1/ and demo2/ (the earlier demos
# from git), measure_*.json, eval.json, lily_eval_*.json, samples.txt. Its summary ends in the
# figures that REGENERATE.md's hand edits need.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
ckpt=$(cd "${1:?usage: regenerate.sh CKPT_INT8 [WORK]}" && pwd)
work=${2:-/tmp/demo_regen}
DEMO1_COMMIT=${DEMO1_COMMIT:-b357310^}  # the last commit with the first demo (13.4M)
DEMO2_COMMIT=${DEMO2_COMMIT:-b357310}   # the second demo (44.4M, 231 s)
cd "$here"
for f in data/tokenizer.json data/val.bin; do
  [ -f "$f" ] || { echo "missing $here/$f (REGENERATE.md: data/)" >&2; exit 1; }
done
if PYTHONPATH="$repo/src" python -c "import lily._core" 2>/dev/null; then
  export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "note: $repo/src has no built lily._core; the installed lily measures" >&2
fi
python -c "import lily, mlx_lm, transformers; print('lily', lily.__file__, 'mlx-lm', mlx_lm.__version__,
  'transformers', transformers.__version__)"
mkdir -p "$work"
rm -rf "$work/bf16" "$work/mlx" "$work/twin" "$work/demo1" "$work/demo2"

# 1. int8 transport format -> bf16 checkpoint; 4-bit package (candidate); random-init twin
python train.py --dequantize "$ckpt" --out "$work/bf16"
python convert.py --hf "$work/bf16" --out "$work/mlx"
python convert.py --hf "$work/bf16" --random-twin --out "$work/twin"
for n in 1 2; do
  c=DEMO${n}_COMMIT
  mkdir -p "$work/demo$n"
  git -C "$repo" archive "${!c}" src/lily/demo | tar -x -C "$work/demo$n" --strip-components=3
done

# 2. the issue's figures: held-out perplexity by mlx-lm (float32) and lily, loops, size
#    (measure.py exits 1 while the goal, new <= 0.6 x the first demo, is not met)
python measure.py --old "$work/demo1" --new "$work/mlx" --json "$work/measure_demo1_vs_demo3.json" \
  | tee "$work/measure_demo1_vs_demo3.txt" || true
python measure.py --old "$work/demo2" --new "$work/mlx" --json "$work/measure_demo2_vs_demo3.json" \
  | tee "$work/measure_demo2_vs_demo3.txt" || true

# 3. references only: perplexities (val.bin, held-out; trained / random / shuffled) and samples
python evaluate.py --hf "$work/bf16" --mlx "$work/mlx" --twin-mlx "$work/twin" --json "$work/eval.json"

# 4. lily eval's agreement with mlx-lm (docs/cli.md, src/lily/evaluate.py: float32 and bfloat16)
for dt in float32 native; do
  python -m lily eval --model "$work/mlx" --cpu-matmul f32 --reference mlx-lm --reference-dtype "$dt" -N 256 \
    --json "$work/lily_eval_$dt.json" >/dev/null
done

# 5. the README's first impression and chat samples, through lily
python - "$work/mlx" > "$work/samples.txt" <<'EOF'
import sys

import lily

m = lily.Model.load(sys.argv[1])
r = m.generate("The json module", seed=0)  # `lily generate "The json module"`: the defaults, seed 0
print("generate defaults seed 0:", repr(r.text))
r = m.generate("The json module", temperature=0, repetition_penalty=1, max_tokens=48)
print("greedy, penalty off:", repr(r.text))
for q in ["What does os.path.join do?", "Tell me a fortune."]:
    r = m.generate([{"role": "user", "content": q}], temperature=0, max_tokens=60)
    print(f"chat greedy {q!r}:", repr(r.text))
EOF
cat "$work/samples.txt"

if [ "${INSTALL:-0}" = 1 ]; then
  # 6. ship: the package, the training records (the previous run's kept under its name), the
  #    loss plot, the fuzz seeds (they copy the demo's config files)
  python convert.py --hf "$work/bf16"  # -> src/lily/demo (the same bytes as $work/mlx)
  cmp "$work/mlx/model.safetensors" "$repo/src/lily/demo/model.safetensors"
  if [ -f train_log.txt ] && [ ! -f train_log_demo2_231s.txt ]; then
    git mv loss.csv loss_demo2_231s.csv
    git mv train_summary.json train_summary_demo2_231s.json
    git mv train_log.txt train_log_demo2_231s.txt
    git mv eval.json eval_demo2.json
  fi
  cp "$ckpt/loss.csv" "$ckpt/train_summary.json" .
  [ -f "$ckpt/train_log.txt" ] && cp "$ckpt/train_log.txt" .
  cp "$work/eval.json" eval.json
  cp "$work/measure_demo1_vs_demo3.json" "$work/measure_demo2_vs_demo3.json" .
  python plot_loss.py loss.csv loss_demo2_231s.csv loss_demo1_185s.csv
  python "$repo/tests/fuzz/make_seeds.py"
  git -C "$repo" status --short
fi

# 7. the figures the hand edits need (REGENERATE.md)
python - "$work" "$ckpt" <<'EOF'
import json
import sys
from pathlib import Path

work, ckpt = Path(sys.argv[1]), Path(sys.argv[2])
s = json.loads((ckpt / "train_summary.json").read_text())
print(f"\nrun: {s['steps']} steps, {s['seconds']} s, {s['tokens'] / 1e6:.1f}M tokens, {s['epochs']} epochs, "
      f"batch {s['batch']}, warmup {s.get('warmup')}, best val loss {s['best_val_loss']} (step {s['best_step']})")
for name in ("demo1", "demo2"):
    m = json.loads((work / f"measure_{name}_vs_demo3.json").read_text())
    for side in ("old", "new"):
        p, loops = m[side]["perplexity"], m[side]["loops"]
        print(f"{name} vs demo3, {side}: ppl mlx-lm {p['per_token_mlx_lm']:.2f} lily {p['per_token_lily']:.2f}, "
              f"{m[side]['package_mb']:.2f} MB, repeated 4-grams {100 * loops['mean_repeated_4grams']:.1f}%, "
              f"longest loop {loops['worst_loop_tokens']}")
    print(f"  ratio new/old {m['ratio']:.3f}")
for name, r in json.loads((work / "eval.json").read_text())["perplexity"].items():
    print("eval.json:", name, r)
for dt in ("float32", "native"):
    e = json.loads((work / f"lily_eval_{dt}.json").read_text())
    print(f"lily eval --cpu-matmul f32 vs mlx-lm in {e['reference_dtype']}: top-1 agreement "
          f"{100 * e['top1_agreement']:.1f}%, ppl {e['perplexity']:.2f} vs {e['reference_perplexity']:.2f}")
EOF
