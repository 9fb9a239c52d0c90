#!/usr/bin/env bash
# One prepared run on a lent GPU machine (no network there): what the CPU machines cannot show.
#   1. bench/throughput.py in bf16 on a mid-sized Llama: tokens/s, MFU against the bf16 matmul peak measured in
#      the same run, and the Keel/HF ratio.
#   2. `keel train` on one GPU (NCCL), dense and MoE (8 experts, top-2, dropless, bias balancing): the CUDA code
#      paths run end to end and the loss falls.
# Usage there: bash bench/device_check.sh [OUT_DIR]. A machine with no network needs DeepSpeed and the deps its
# image lacks as wheels in .whl/ (made beforehand where pip works; the image had Python 3.12):
#   DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8 -w .whl
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl hjson pydantic pydantic_core annotated-types typing-inspection
set -u
out=${1:-${OUT:-/tmp/device_check}}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"

[ -n "${SKIP_THROUGHPUT:-}" ] || timeout 300 python3 bench/throughput.py --precision bf16 --ds-config ds_configs/bf16.json --dim 2048 --layers 8 \
  --heads 16 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 4 --steps 10 --warmup 3 2>&1 \
  | grep -v "^\[20" | tee "$out/throughput.txt"

common=(--nproc 1 --set train.steps=60 --set train.eval_interval=0 --set checkpoint.interval=0
        --set logging.log_interval=20 --set data.seq_len=256 --set model.dim=256 --set train.micro_batch_size=8
        --set train.global_batch_size=16)
timeout 150 python3 -m keel.launcher.cli train --run-dir /tmp/dense "${common[@]}" > "$out/train_dense.txt" 2>&1
grep -v "^\[20" "$out/train_dense.txt" | tail -12
timeout 150 python3 -m keel.launcher.cli train --run-dir /tmp/moe "${common[@]}" --set model.moe_experts=8 \
  --set model.moe_bias_update=0.001 --set stability.expert_interval=20 > "$out/train_moe.txt" 2>&1
grep -v "^\[20" "$out/train_moe.txt" | tail -12
cp /tmp/moe/metrics.jsonl "$out/moe_metrics.jsonl" 2>/dev/null
exit 0
