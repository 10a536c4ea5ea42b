#!/usr/bin/env bash
# The demo model's training run, as one device call on an nvidia-h200 (no network there): the
# carried transformers wheel is installed beside the image's torch, then train.py trains the
# "medium" model for $BUDGET_S seconds (default 360) with the batch size it times first, and the
# checkpoint lands in $OUT/ckpt: 4 safetensors shards (bf16, 56.8 MB) + index + config + loss.csv
# + train_summary.json = the 8 files a device call can return.
#
# Carried (prepared here first; README.md "Retraining" lists the commands):
#   scripts/demo_model/data/{train.bin,val.bin,tokenizer.json}   (~31 MB)
#   .whl/transformers-5.24.0-py3-none-any.whl                  (13.5 MB)
# SMOKE=1 runs train.py --smoke on the CPU instead (proves the script anywhere, ~2 minutes).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
out=${OUT:?set OUT to the folder the checkpoint goes to}
export PYTHONUNBUFFERED=1
if ls "$root"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$root"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"
for f in train.bin val.bin tokenizer.json; do
  [ -f "$here/data/$f" ] || { echo "missing scripts/demo_model/data/$f: carry it (README.md)" >&2; exit 1; }
done
if [ "${SMOKE:-0}" = 1 ]; then
  python3 "$here/train.py" --data "$here/data" --out "$out/ckpt" --size medium --smoke --batch auto --eval-seconds 8
else
  python3 "$here/train.py" --data "$here/data" --out "$out/ckpt" --size medium --batch auto \
    --seconds "${BUDGET_S:-360}" --eval-seconds 20
fi
ls -l "$out/ckpt"
