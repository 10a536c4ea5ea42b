#!/usr/bin/env bash
# The demo model's training run, as one device call on an nvidia-h200 (no network there): the
# carried wheels (transformers 5.24) are installed beside the image's torch, the carried corpus
# text is tokenized with the shipped tokenizer, then train.py trains the $SIZE model (default
# "large") for $BUDGET_S seconds of steps (default 270), and the checkpoint lands in $OUT/ckpt:
# int8 safetensors shards + index + config + loss.csv + train_summary.json (7 files: a call
# returns at most 8).
#
# Carried (prepared here first; README.md lists the commands):
#   $DATA (default scripts/demo_model/data): tokenizer.json and train.txt.xz + val.txt.xz
#       (or train.bin + val.bin already tokenized)
#   $WHEELS (default .whl): the transformers-5.24.0 wheel (the image's tokenizers 0.23.2 and
#       huggingface_hub 1.33 satisfy it)
# Recipe knobs (environment): BATCH (sequences of 512 tokens a step, or "auto": time 32..512
# first and keep the fastest; default auto), WARMUP (linear warm-up steps, default 100), LR
# (peak, default 2e-3), EVAL_S (seconds between validations, default 20), BUDGET_S, SIZE.
# SMOKE=1 runs train.py --smoke on the CPU instead (proves the script anywhere, ~3 minutes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
data=${DATA:-$here/data}
wheels=${WHEELS:-$here/../../.whl}
out=${OUT:?set OUT to the folder the checkpoint goes to}
export PYTHONUNBUFFERED=1
if ls "$wheels"/*.whl >/dev/null 2>&1; then
  site=${SITE:-/tmp/site}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
if [ ! -f "$data/train.bin" ] && [ -f "$data/train.txt.xz" ]; then
  # Tokenizing here (16 cores) costs seconds; the text travels 3x smaller under xz than its ids.
  python3 -c "import lzma, shutil, sys
for f in ('train', 'val'):
    with lzma.open(f'{sys.argv[1]}/{f}.txt.xz') as src, open(f'{sys.argv[1]}/{f}.txt', 'wb') as dst:
        shutil.copyfileobj(src, dst, 1 << 24)" "$data"
  python3 "$here/train_tokenizer.py" --data "$data" --reuse "$data/tokenizer.json"
fi
for f in train.bin val.bin tokenizer.json; do
  [ -f "$data/$f" ] || { echo "missing $data/$f: carry it (README.md)" >&2; exit 1; }
done
if [ "${SMOKE:-0}" = 1 ]; then
  python3 "$here/train.py" --data "$data" --out "$out/ckpt" --size "${SIZE:-large}" --smoke --batch "${BATCH:-auto}" \
    --eval-seconds 8 --export int8
else
  python3 "$here/train.py" --data "$data" --out "$out/ckpt" --size "${SIZE:-large}" --batch "${BATCH:-auto}" \
    --warmup "${WARMUP:-100}" --lr "${LR:-2e-3}" --seconds "${BUDGET_S:-270}" --eval-seconds "${EVAL_S:-20}" \
    --export int8
fi
ls -l "$out/ckpt"
