# GPT-2 small (124M parameters) as the GPT-2 paper and nanoGPT train it: ~0.5M tokens per
# step (16 sequences x 1024 tokens x 32 accumulation steps), AdamW(0.9, 0.95), weight
# decay 0.1, lr 6e-4 warmed up over 2000 steps and decayed by cosine to 6e-5.
# Data: `python data/fineweb/prepare.py` (FineWeb-Edu 10B tokens, see docs/training.md), or
# --dataset=openwebtext after `python data/openwebtext/prepare.py`.
out_dir = "out-gpt2-124m"
dataset = "fineweb_edu_10bt"

n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
dropout = 0.0
bias = True
pad_vocab_to_multiple = 64  # 50257 -> 50304: matmul-friendly; padding logits are masked
dtype = "bfloat16"
# The 12 layers written out and nothing recomputed: on one TPU v5e at batch 16, 127.1 ms a step (MFU 56.0%,
# 8,682 MiB) against 137.9 ms (51.6%, 12,209 MiB) scanned with the matmuls' outputs saved (the same day's
# code); its compile takes 125 s there instead of ~40. Sampling and serving scan the layers whatever this says (inference/loader.py).
scan_layers = False
remat_policy = "none"

batch_size = 16  # over all devices; raise it and lower accumulation on bigger meshes
gradient_accumulation_steps = 32
learning_rate = 6e-4
max_iters = 600_000
lr_decay_iters = 600_000
warmup_iters = 2000
min_lr = 6e-5
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 200
log_interval = 10
