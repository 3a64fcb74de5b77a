#!/usr/bin/env bash
# The CUDA path in one command, under 8 minutes on one GPU:
#   1. the gpu-marked tests (fp16 with dynamic loss scaling through deepy.py, the accelerator's RNG state,
#      flash/memory-efficient attention through SDPA, FusedAdam);
#   2. the engine-path tests on CUDA: module-only loads in bf16/fp16/fp32 x ZeRO 0-3 with master refresh and
#      verification, exact, and the verification failing without the refresh;
#   3. the training step of a ~1B-parameter Llama-shaped model against transformers' (bf16, ZeRO-1): tokens/s,
#      model FLOPs utilisation against the GPU's dense bf16 peak, peak GPU memory.
# Without a GPU it says so in one line and exits 0.
#   bash tools/gpu_check.sh [OUT_DIR]        (the bench's JSON goes to OUT_DIR, default /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-/tmp}"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no GPU on this machine (torch.cuda.is_available() is false); nothing to check"
    exit 0
fi
export PYTHONUNBUFFERED=1
python -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), 'torch', torch.__version__)"
status=0
timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/e2e/test_gpu.py || status=1
timeout 150 python -m pytest -q -p no:cacheprovider tests/unit/test_ckpt_engine.py \
    -k "module_only_load_survives_a_step or verification_fails_without_master_refresh" || status=1
timeout 180 python tools/bench/bench_train_step.py --family llama --precision bf16 --layers 24 --hidden 2048 \
    --heads 16 --kv-heads 16 --seq 2048 --batch 4 --vocab 32000 --repeats 5 --no-profile \
    --json "$out/gpu_check_train_step.json" || status=1
exit "$status"
