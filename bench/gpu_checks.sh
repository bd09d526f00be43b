#!/usr/bin/env bash
# The checks a lent GPU machine runs in one call (docs/SCALE.md, "Measured on GPUs"): the device and
# its software, then bench/bench_accelerator.py's and bench/bench_decode_kernels.py's rows, each
# variant in a process of its own (XLA reads XLA_FLAGS once a process). The log (log.txt), the rows as
# JSON (rows.jsonl) and the traces go to $OUT (default /tmp/gpu_checks): four files at most, as a lent
# machine sends back eight.
#
#     bash bench/gpu_checks.sh [sample,decode,train,flags,forms,fp8|all]     (default all, in this order)
#
#   sample   sampling tokens/s at batch 1 and 32, bf16 weights: XLA's attention and cuDNN's over
#            the cache; with BEFORE=DIR (a copy of an earlier tree: git archive REV
#            jaxgpt bench configs) also that tree's bf16 row, for a before and after on one machine
#   decode   the launches a token takes, counted in the program; one generation at batch 1 traced
#   train    GPT-2 small's train step as shipped, two steps traced
#   forms    sampling with the weights as trained (float32) and with XLA's own product of few rows
#   fp8      the same with compute.fp8 (mlp; mlp,unembed), and with XLA's Triton GEMMs off
#   flags    sampling with cuBLAS's GEMMs instead of Triton's; the train step with cuDNN's LayerNorm
#
# Where a package is missing there (no network), its wheels travel in .whl/ and are installed first.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
WHAT=${1:-all}
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
$PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"

BENCH="$PY bench/bench_accelerator.py --configs gpt2_124m --json $OUT/rows.jsonl"
SAMPLE="$BENCH --kernels xla --loss_chunks preset --sample_only"
TRAIN="$BENCH --kernels cudnn --loss_chunks preset --sample none --steps 3"

run() {  # run NAME SECONDS XLA_FLAGS ARGS…: one variant, its output added to $OUT/log.txt, its last lines shown
    local name=$1 seconds=$2 flags=$3
    shift 3
    echo "=== $name (XLA_FLAGS='$flags')" | tee -a "$OUT/log.txt"
    XLA_FLAGS="$flags" timeout "$seconds" "$@" > /tmp/variant.log 2>&1
    echo "exit $?" | tee -a "$OUT/log.txt"
    echo "{\"variant\": \"$name\", \"xla_flags\": \"$flags\"}" >> "$OUT/rows.jsonl"
    cat /tmp/variant.log >> "$OUT/log.txt"
    grep -E '^\{|Error|error' /tmp/variant.log | cut -c1-400 | tail -4
}

traced() {  # traced FOLDER NAME: the perfetto trace jax.profiler wrote under FOLDER, as $OUT/NAME
    find "$1" -name 'perfetto_trace.json.gz' -exec cp {} "$OUT/$2" \; 2>/dev/null
}

is() { [[ ,$WHAT, == *,$1,* || $WHAT == all ]]; }  # WHAT: all, or names joined by commas

if is sample; then
    run sample_bf16 120 "" $SAMPLE
    if [[ -n ${BEFORE:-} ]]; then
        run sample_bf16_before 120 "" $PY "$BEFORE/bench/bench_accelerator.py" --configs gpt2_124m \
            --json $OUT/rows.jsonl --kernels xla --loss_chunks preset --sample_only
    fi
    run sample_bf16_cudnn 120 "" ${SAMPLE/--kernels xla/--kernels cudnn}
fi
if is decode; then
    run decode_kernels 150 "" $PY bench/bench_decode_kernels.py --topology here --batch 1,32 --weights compute --matmul auto
    tail -5 /tmp/variant.log
    run decode_trace 150 "" $SAMPLE --new 64 --profile /tmp/decode_trace
    traced /tmp/decode_trace decode_trace.json.gz
fi
if is train; then
    run train_preset 200 "" $TRAIN --profile /tmp/train_trace
    traced /tmp/train_trace train_trace.json.gz
fi
if is flags; then
    run sample_cublas 120 "--xla_gpu_enable_triton_gemm=false" $SAMPLE
    run train_cudnn_layer_norm 200 "--xla_gpu_enable_cudnn_layer_norm=true" $TRAIN
fi
if is forms; then
    run sample_as_trained 120 "" $SAMPLE --sample_weights param --matmul xla
    run sample_bf16_xla 120 "" $SAMPLE --matmul xla
fi
if is fp8; then
    run train_fp8_mlp 200 "" $TRAIN --fp8 mlp
    run train_fp8_mlp_unembed 200 "" $TRAIN --fp8 mlp,unembed
    run train_fp8_mlp_cublas 200 "--xla_gpu_enable_triton_gemm=false" $TRAIN --fp8 mlp
fi
echo "=== rows"
cut -c1-300 "$OUT/rows.jsonl" 2>/dev/null
