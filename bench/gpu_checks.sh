#!/usr/bin/env bash
# The checks a lent GPU machine runs in one call (docs/SCALE.md, "On one H100"): the device and its
# software, then bench/bench_accelerator.py's rows, each variant in a process of its own (XLA reads
# XLA_FLAGS once a process). Logs and the step's trace go to $OUT (default /tmp/gpu_checks).
#
#     bash bench/gpu_checks.sh [sample|train|fp8|all]     (default all)
#
# Where a package is missing there (no network), its wheels travel in .whl/ and are installed first.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
WHAT=${1:-all}
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
XLA_FLAGS=--help $PY -c "import jax; jax.numpy.zeros(1)" > "$OUT/xla_help.txt" 2>&1

BENCH="$PY bench/bench_accelerator.py --configs gpt2_124m --json $OUT/rows.jsonl"
WHILE_GRAPHS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"

run() {  # run NAME SECONDS XLA_FLAGS ARGS…: one variant, its log in $OUT/NAME.log, its last lines shown
    local name=$1 seconds=$2 flags=$3
    shift 3
    echo "=== $name (XLA_FLAGS='$flags')"
    XLA_FLAGS="$flags" timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
    echo "exit $?"
    grep -E '^\{|Error|error' "$OUT/$name.log" | cut -c1-400 | tail -6
}

if [[ $WHAT == sample || $WHAT == all ]]; then
    run sample_as_trained 120 "" $BENCH --kernels xla --loss_chunks preset --sample_only --sample_weights param
    run sample_bf16 120 "" $BENCH --kernels xla --loss_chunks preset --sample_only
    run sample_bf16_while_graphs 120 "$WHILE_GRAPHS" $BENCH --kernels xla --loss_chunks preset --sample_only
fi
if [[ $WHAT == decode || $WHAT == all ]]; then  # one generation at batch 1 traced; the launches per token
    run decode_trace 150 "" $BENCH --kernels xla --loss_chunks preset --sample_only --new 64 --profile /tmp/dtrace
    find /tmp/dtrace -name 'perfetto_trace.json.gz' -exec cp {} "$OUT/decode_trace.json.gz" \; 2>/dev/null
    run decode_kernels 120 "" $PY bench/bench_decode_kernels.py --topology here --batch 1 --weights compute
    tail -4 "$OUT/decode_kernels.log"
    NO_REDUCE="--xla_gpu_enable_dot_strength_reduction=false"
    run decode_kernels_gemv 120 "$NO_REDUCE" $PY bench/bench_decode_kernels.py --topology here --batch 1 \
        --weights compute
    tail -4 "$OUT/decode_kernels_gemv.log"
    run sample_gemv 120 "$NO_REDUCE" $BENCH --kernels xla --loss_chunks preset --sample_only
    run sample_gemv_while_graphs 120 "$NO_REDUCE $WHILE_GRAPHS" $BENCH --kernels xla --loss_chunks preset --sample_only
fi
if [[ $WHAT == train || $WHAT == all ]]; then
    run train_preset 200 "" $BENCH --kernels cudnn --loss_chunks preset --sample none --steps 3 \
        --profile /tmp/trace
    find /tmp/trace -name 'perfetto_trace.json.gz' -exec cp {} "$OUT/train_trace.json.gz" \; 2>/dev/null
    run train_cublas 150 "--xla_gpu_enable_triton_gemm=false" $BENCH --kernels cudnn --loss_chunks preset \
        --sample none --steps 3
fi
if [[ $WHAT == fp8 || $WHAT == all ]]; then
    run train_fp8 200 "" $BENCH --kernels cudnn --loss_chunks preset --sample none --steps 3 --fp8 mlp,unembed
fi
echo "=== rows"
cat "$OUT/rows.jsonl" 2>/dev/null | cut -c1-300
