#!/usr/bin/env bash
# One prepared run on a lent GPU machine (no network there): what the CPU machines cannot show. ≤ 5 minutes.
# Stages (all by default; choose with STAGES="gpu-tests dense-z1 ..." in the environment):
#   gpu-tests   pytest -m gpu: the model on CUDA equals the CPU reference; the channel rule on real CUDA tensors;
#               Liger's RMSNorm/RoPE/SwiGLU and a whole model with model.kernels=liger against the torch path.
#   throughput  bench/throughput.py in bf16 on a mid-sized Llama: tokens/s, MFU, the Keel/HF ratio, time outside GEMMs.
#   throughput-compile  (only when named) the same with --compile: the first step's compilation time and the
#               compiled step, the figures model.compile=auto needs before it may compile on CUDA.
#   gemm        bench/gemm_efficiency.py: bf16 TFLOP/s of a Llama block's GEMMs by width and tokens (the efficiency
#               curve a step-time model fits), and FP8 _scaled_mm (tensorwise, rowwise) on the same shapes.
#   kernels     bench/kernels.py in bf16: RMSNorm, RoPE, SwiGLU, CE, linear+CE fwd+bwd time and peak memory, eager
#               vs torch.compile vs Liger (liger-kernel from .whl: `pip download --no-deps liger-kernel -d .whl`).
#   fp8         bench/fp8_throughput.py: a ~0.7B Llama at seq 4096, compiled, BF16 vs model.fp8 tensorwise and rowwise
#               in one interleaved run: tokens/s ratios (target tensorwise >= 1.25x) and the losses of 200 steps.
#               torchao from .whl (`pip download --no-deps torchao==0.18.0 -d .whl`). MX formats need Blackwell:
#               on H100/H200 there is no MX stage.
#   plan        bench/plan_gpu.py: `keel plan`'s best single-GPU layout for two ~1B models at seq 4096, trained a few
#               steps: predicted vs measured tokens/s and peak memory.
#   dense-z1 dense-z2 dense-z3 moe-z1 moe-z2
#               `keel train` on one GPU (NCCL + gloo control group) through the paths that need no second GPU,
#               covered pairwise: ZeRO-1/2/3 dense and ZeRO-1/2 MoE, fp16 and bf16 each twice or more, monitor
#               and checksums on in every run, and a resume (stop at step 30, start again) in three of them.
#               logging.sync_debug=warn counts the synchronizing CUDA calls per optimizer step (syncs.txt).
#               Each prints its last log lines and its peak GPU memory (next to Keel's memory model when present).
# Stages run in the order STAGES names them, so the ones that matter most can go first under a tight lease.
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
stages=${STAGES:-gpu-tests fp8 plan throughput gemm kernels dense-z1 dense-z2 dense-z3 moe-z1 moe-z2}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"

gpu_tests() {
  # the whole report in the file (a failure's message included), its last lines on the console
  timeout 150 python3 -m pytest -o addopts='' -q -rA --tb=short -m gpu tests/test_gpu.py tests/test_kernels.py \
    -p no:cacheprovider > "$out/gpu_tests.txt" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests.txt" | tail -12
}
# Keel's whole trainer step (data prepared from the stdlib corpus first, ~10 s) vs the plain HF loop
# throughput SECONDS [extra flags]
throughput() {
  local limit=$1
  shift
  timeout "$limit" python3 bench/throughput.py --precision bf16 --ds-config ds_configs/bf16.json --dim 2048 --layers 8 \
    --heads 16 --kv-heads 8 --vocab 32000 --seq-len 2048 --micro-batch 4 --steps 8 --warmup 2 "$@" 2>&1 \
    | grep -v -e "^\[20" -e "^USDT"
}
gemm() {
  timeout 120 python3 bench/gemm_efficiency.py --repeats 10 2>&1 | tee "$out/gemm.txt"
}
kernels() {
  timeout 90 python3 bench/kernels.py --repeats 10 2>&1 | grep -v "^\[20" | tee "$out/kernels.txt"
}

# ds_config STAGE PRECISION → a DeepSpeed JSON in $out (ZeRO stage from zeroN.json, precision section added)
ds_config() {
  python3 - "$1" "$2" "$out/ds_z$1_$2.json" <<'EOF'
import json, sys
stage, precision, path = sys.argv[1:]
ds = json.load(open(f"ds_configs/zero{stage}.json"))
ds[precision] = {"enabled": True, **({"initial_scale_power": 12} if precision == "fp16" else {})}
json.dump(ds, open(path, "w"), indent=1)
print(path)
EOF
}

common=(--nproc 1 --set train.steps=60 --set train.eval_interval=30 --set checkpoint.interval=30
        --set logging.log_interval=20 --set data.seq_len=256 --set model.dim=256 --set train.micro_batch_size=8
        --set train.global_batch_size=16 --set stability.monitor_interval=10 --set stability.checksum_interval=10
        --set logging.sync_debug=warn)
moe=(--set model.moe_experts=8 --set model.moe_bias_update=0.001 --set stability.expert_interval=20)

# train NAME STAGE PRECISION RESUME(0/1) [extra --set ...]
train() {
  local name=$1 stage=$2 prec=$3 resume=$4
  shift 4
  local cfg run=/tmp/keel_$name
  cfg=$(ds_config "$stage" "$prec")
  rm -rf "$run"
  if [ "$resume" = 1 ]; then
    timeout 100 python3 -m keel.launcher.cli train --run-dir "$run" --ds-config "$cfg" "${common[@]}" "$@" \
      --set train.exit_after=30 > "$out/train_$name.txt" 2>&1
  fi
  timeout 100 python3 -m keel.launcher.cli train --run-dir "$run" --ds-config "$cfg" "${common[@]}" "$@" \
    >> "$out/train_$name.txt" 2>&1
  echo "== $name: exit $? (ZeRO-$stage $prec, resume=$resume)"
  grep -v "^\[20" "$out/train_$name.txt" | grep -E "step +[0-9]+|resumed|finished|error|Error" | tail -6
  cp "$run/metrics.jsonl" "$out/metrics_$name.jsonl" 2>/dev/null
  cp "$run/anomalies.jsonl" "$out/anomalies_$name.jsonl" 2>/dev/null
  # torch.cuda.set_sync_debug_mode("warn") over the optimizer steps: synchronizing calls per step, top sites
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], 'syncs/step', \
round(r['syncs'] / max(r['steps'], 1), 2), list(r['sites'].items())[:4])" "$run/sync_debug_rank0.json" "$name" \
    2>&1 | tee -a "$out/syncs.txt"
  # peak GPU memory next to the memory model, once keel/engine/memory_model.py exists (branch `memory`)
  if [ -f bench/memory_vs_model.py ]; then
    python3 bench/memory_vs_model.py "$run" 2>&1 | tee -a "$out/memory.txt"
  else
    python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(sys.argv[2], 'peak GPU GiB', \
max((x.get('gpu_mem_peak_gib', 0) for x in r), default=None))" "$run/metrics.jsonl" "$name" | tee -a "$out/memory.txt"
  fi
}

for stage in $stages; do
  echo "== stage $stage ($(date +%T))"
  case $stage in
    gpu-tests) gpu_tests ;;
    throughput) throughput 180 --profile-steps 2 | tee "$out/throughput.txt" ;;
    throughput-compile) throughput 240 --profile-steps 0 --compile | tee "$out/throughput_compile.txt" ;;
    gemm) gemm ;;
    fp8) timeout 300 python3 bench/fp8_throughput.py 2>&1 | grep -v "^\[20" | tee "$out/fp8.txt" ;;
    plan) timeout 300 python3 bench/plan_gpu.py --device h200 2>&1 | grep -v "^\[20" | tee "$out/plan.txt" ;;
    kernels) kernels ;;
    dense-z1) train dense-z1 1 fp16 1 ;;
    dense-z2) train dense-z2 2 bf16 0 ;;
    dense-z3) train dense-z3 3 bf16 1 ;;
    moe-z1) train moe-z1 1 bf16 0 "${moe[@]}" ;;
    moe-z2) train moe-z2 2 fp16 1 "${moe[@]}" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
# the device tool brings back at most 8 files from $OUT: everything goes back as one archive
if [ -n "${OUT:-}" ] && [ "$out" = "$OUT" ]; then
  tar czf /tmp/device_check.tgz -C "$out" . && find "$out" -mindepth 1 -delete && mv /tmp/device_check.tgz "$out/"
fi
exit 0
