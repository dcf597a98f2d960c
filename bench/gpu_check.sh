#!/usr/bin/env bash
# The GPU speed checks of issue 6 in one go (about 8 minutes on an H100/H200), from the repo root:
#     OUT=bench-gpu bash bench/gpu_check.sh
# 1. cuDNN flash attention (jax.nn.dot_product_attention, implementation='cudnn') on bf16:
#    does it run, does it agree with float32, how fast against XLA's attention.
# 2. bench.py, GPT-2 124M, T=1024, bf16, vocab 50304, donated state: attention cudnn vs XLA,
#    remat none / dots_with_no_batch_dims_saveable / full, batch 16 and 32, one XLA flag set.
# 3. bench.py --mode=decode at batch 1 and 64 (memory-bandwidth roofline), scan vs unrolled.
# 4. int8 and fp8 quantized training (issue 10) against bf16 at the headline shape.
# A trace of the headline run's steps is summarized (top ops) and kept as $OUT/trace.json.gz.
# Every bench run appends to $OUT/bench.jsonl; the last lines are one table of all of them.
# Each run has its own process (a fresh peak-memory counter; an OOM ends only that run) and a
# time limit; runs are in order of importance and those that would start after BUDGET seconds
# are skipped (and said so). MODEL/EXTRA change the model for a dry run, e.g. on a CPU:
#     ATTN=xla MODEL="config/shakespeare_char.py --vocab_size=65" EXTRA="--dtype=float32 --n_layer=2 --block_size=576" bash bench/gpu_check.sh
set -u
OUT=${OUT:-bench-gpu}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-420}
MODEL=${MODEL:-config/gpt2_124m.py}
EXTRA=${EXTRA:-}
ATTN=${ATTN:-cudnn}  # xla for a dry run on a CPU
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
LOG="$OUT/log.txt"
start=$SECONDS

run() {  # run [ENV=VALUE ...] COMMAND...: in its own process, logged, skipped past the budget
  if [ $((SECONDS - start)) -gt "$BUDGET" ]; then
    echo "=== skipped (over BUDGET=$BUDGET s): $*" | tee -a "$LOG"; return
  fi
  echo "=== [$((SECONDS - start)) s] $*" | tee -a "$LOG"
  env "$@" 2>&1 | tee -a "$LOG" | grep -v "^[WI]0000\|^WARNING: All log messages"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "    (exit status $rc)" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv 2>&1 | tee "$OUT/gpu.txt"
run timeout 90 $PY bench/gpu_run.py --check_attention

T="timeout 150 $PY bench/gpu_run.py"
G="$MODEL --gradient_accumulation_steps=1 --steps=10 --warmup=2 --dtype=bfloat16 --json=$OUT/bench.jsonl"
D="$MODEL --mode=decode --dtype=bfloat16 --decode_batch=1,64 --prompt_len=64 --new_tokens=512 --steps=3 --json=$OUT/bench.jsonl"
# The headline first (with a trace of 3 steps), then what each choice moves.
TRACE=/tmp/nanomax-bench-trace  # the profiler nests files deeply: keep only the Perfetto file in $OUT
rm -rf "$TRACE"
run $T --attention=$ATTN $G --batch_size=16 --remat_policy=none --profile=$TRACE $EXTRA
run $PY bench/gpu_run.py --top_ops=$TRACE
cp "$(ls "$TRACE"/plugins/profile/*/*.trace.json.gz 2>/dev/null | tail -1)" "$OUT/trace.json.gz" 2>/dev/null
run $T --attention=xla $G --batch_size=16 --remat_policy=none $EXTRA
run $T --attention=$ATTN $D --scan_layers=True $EXTRA  # the config writes its layers out
run $T --attention=$ATTN $G --batch_size=16 --remat_policy=none --quantization=int8 $EXTRA
run $T --attention=$ATTN $G --batch_size=16 --remat_policy=none --quantization=fp8 $EXTRA
run $T --attention=$ATTN $G --batch_size=32 --remat_policy=none $EXTRA
run $T --attention=$ATTN $G --batch_size=32 --remat_policy=dots_with_no_batch_dims_saveable $EXTRA
run XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_triton_gemm=false" \
    $T --attention=$ATTN $G --batch_size=16 --remat_policy=none $EXTRA
run $T --attention=$ATTN $D --scan_layers=False $EXTRA
run $T --attention=$ATTN $G --batch_size=16 --remat_policy=full $EXTRA

echo "=== summary ($((SECONDS - start)) s)" | tee -a "$LOG"
$PY bench/gpu_run.py --summary="$OUT/bench.jsonl" | tee "$OUT/summary.txt"
