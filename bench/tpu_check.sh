#!/usr/bin/env bash
# The TPU checks of issues 50-52 and 65-66 (longer than one 10-minute device call: PARTS splits them), from the repo root,
# with the project's requirements-dev.txt and JAX's TPU build installed:
#     OUT=bench-tpu bash bench/tpu_check.sh
# In order of what is least measured: the chip's own tests, serving through a unix socket (a
# GPT-2-shaped checkpoint made offline: this repository's docs as text, two training steps),
# the splash path's losses against the written-out attention, llama_350m and GPT-2 training with
# a profile, then the decode table in bf16, int8 weights and an int8 cache.
# Each run has its own process and time limit; runs that would start after BUDGET seconds are
# skipped (and said so). Every bench.py run appends to $OUT/bench.jsonl. A dry run on a CPU
# (tiny shapes, a minute or two):
#     DRY_RUN=1 OUT=/tmp/tpu-dry bash bench/tpu_check.sh
# PARTS picks some of the groups (a device call may have a shorter limit than the whole):
#     PARTS="tests agree train" OUT=bench-tpu bash bench/tpu_check.sh
set -u
OUT=${OUT:-bench-tpu}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-660}
PARTS=${PARTS:-tests serve agree train decode}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
start=$SECONDS

part() { [[ " $PARTS " == *" $1 "* ]]; }  # part NAME: was NAME asked for?

run() {  # run COMMAND...: logged, skipped past the budget
  if [ $((SECONDS - start)) -gt "$BUDGET" ]; then
    echo "=== skipped (over BUDGET=$BUDGET s): $*" | tee -a "$LOG"; return
  fi
  echo "=== [$((SECONDS - start)) s] $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG" | grep -v "^request \|UserWarning: Transparent hugepages\|warnings.warn("
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] || echo "    (exit status $rc)" | tee -a "$LOG"
}

GPT2="config/gpt2_124m.py"
LLAMA="config/llama_350m.py --batch_size=4"
RECORD="config/llama_164m_mqa.py"  # the published single-chip record's shape
TRAIN="--gradient_accumulation_steps=1"
STEPS=""  # bench.py's timed steps: its defaults
DECODE="--decode_batch=1,16,64,256"
SLOTS=256
TESTS=(env NANOMAX_TEST_PLATFORM=tpu timeout 300 "$PY" -m pytest -p no:cacheprovider -n 0 -m tpu -q)
if [ -n "${DRY_RUN:-}" ]; then  # the same runs at shapes a CPU does in seconds
  TINY="--n_layer=2 --n_head=4 --n_embd=128 --block_size=256 --dtype=float32"
  GPT2="$GPT2 $TINY"; LLAMA="$LLAMA $TINY --n_kv_head=2"; RECORD="$RECORD $TINY --n_kv_head=1 --batch_size=2 --gradient_accumulation_steps=2"; STEPS="--steps=2 --warmup=1"
  DECODE="--decode_batch=1,4"; SLOTS=4
  TESTS=(echo "(the chip's tests skip on a CPU)"); AGREE="--n_layer=2 --steps=3 --compare=xla,einsum"
fi
B="$STEPS --json=$OUT/bench.jsonl"

part tests && run "${TESTS[@]}"

# Serving: a checkpoint of GPT-2's shape from text that needs no download, then serve.py on a
# unix socket (a TPU VM may allow no TCP port) and bench_serve.py against it.
SOCKET=/tmp/nanomax-tpu-check.sock CKPT=/tmp/nanomax-tpu-check-gpt2
if part serve; then
  rm -rf /tmp/nanomax-tpu-check-docs && mkdir -p /tmp/nanomax-tpu-check-docs
  for page in README.md docs/*.md; do cp "$page" "/tmp/nanomax-tpu-check-docs/$(basename "$page").txt"; done
  run timeout 60 "$PY" data/text/prepare.py --input_dir=/tmp/nanomax-tpu-check-docs --val_fraction=0.2 \
      --out_dir=/tmp/nanomax-tpu-check-text
  # a context of 256 (prompt and 128 new tokens fit): fewer programs for serve.py to compile than 1,024's;
  # the layers scanned, which compiles sooner (serving scans them whatever the checkpoint trained with)
  run timeout 200 "$PY" train.py $GPT2 --scan_layers=True --block_size=256 --data_dir=/tmp --dataset=nanomax-tpu-check-text --batch_size=8 $TRAIN \
      --max_iters=2 --eval_interval=2 --eval_iters=1 --out_dir=$CKPT --overwrite_out_dir=True
  rm -f $SOCKET
  timeout 660 "$PY" serve.py --out_dir=$CKPT --uds=$SOCKET --slots=$SLOTS --max_queue=1024 > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 120); do [ -S $SOCKET ] || ! kill -0 $SERVER 2>/dev/null && break; sleep 1; done
  # the first waits for the programs to compile (GET /health: 503 until then; 140 s on a v5e with the kernel)
  run timeout 360 "$PY" bench_serve.py --uds=$SOCKET --url=http://localhost/v1 --concurrency=1,16 --requests=32 \
      --max_tokens=128 --json="$OUT/serve_1_16.json"
  run timeout 120 "$PY" bench_serve.py --uds=$SOCKET --url=http://localhost/v1 --concurrency=64,$SLOTS \
      --requests=$((2 * SLOTS)) --max_tokens=128 --processes=8 --json="$OUT/serve_64_$SLOTS.json"
  kill -INT $SERVER 2>/dev/null; wait $SERVER
  grep -v "^request " "$OUT/serve.log" | tail -5 | tee -a "$LOG"
  # the same server again: its programs from the compilation cache (the start-up's loaded and ready lines)
  rm -f $SOCKET
  timeout 300 "$PY" serve.py --out_dir=$CKPT --uds=$SOCKET --slots=$SLOTS --max_queue=1024 > "$OUT/serve_again.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 300); do grep -q "^ready " "$OUT/serve_again.log" || ! kill -0 $SERVER 2>/dev/null && break; sleep 1; done
  kill -INT $SERVER 2>/dev/null; wait $SERVER
  grep -E "^(loaded|ready|error)" "$OUT/serve.log" "$OUT/serve_again.log" | tee -a "$LOG"
fi

part agree && run timeout 120 "$PY" bench/attention_agreement.py config/shakespeare_char.py --compare=splash,einsum --steps=50 \
    --dtype=float32 --document_masking=True ${AGREE:-}
SCANNED="--scan_layers=True --remat_policy=dots_with_no_batch_dims_saveable"  # the configs write their layers out
part train && run timeout 330 "$PY" bench.py $LLAMA $TRAIN $B
part train && run timeout 200 "$PY" bench.py $GPT2 --batch_size=16 $TRAIN --profile=/tmp/nanomax-tpu-check-trace $B
part train && run timeout 150 "$PY" bench.py $GPT2 --batch_size=16 $TRAIN $SCANNED $B
part train && run timeout 150 "$PY" bench.py $LLAMA $TRAIN $SCANNED $B
part train && run timeout 200 "$PY" bench.py $RECORD $B
part decode && run timeout 200 "$PY" bench.py $GPT2 --mode=decode $DECODE --profile=/tmp/nanomax-tpu-check-trace $B
part decode && run timeout 150 "$PY" bench.py $GPT2 --mode=decode $DECODE --weight_dtype=int8 $B
part decode && run timeout 150 "$PY" bench.py $GPT2 --mode=decode $DECODE --kv_cache_dtype=int8 $B
echo "=== done in $((SECONDS - start)) s" | tee -a "$LOG"
