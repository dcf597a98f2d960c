# A Llama-style decoder of 358M parameters for one TPU v5e chip (15.75 GiB): rotary positions,
# RMSNorm, SwiGLU, grouped-query attention (8 query heads of 128 share 4 key/value heads), no
# biases, its own output layer, 2048-token rows. With AdamW its float32 parameters, gradients and
# two moments take 16 bytes a parameter (5.7 GB); the rest of the chip holds the activations.
#   python bench.py config/llama_350m.py --gradient_accumulation_steps=1
#   python train.py config/llama_350m.py
# Data: `python data/fineweb/prepare.py` (FineWeb-Edu, GPT-2's tokenizer), as config/gpt2_124m.py.
out_dir = "out-llama-350m"
dataset = "fineweb_edu_10bt"

n_layer = 22
n_head = 8
n_kv_head = 4
n_embd = 1024  # head size 128
block_size = 2048
pos_embedding = "rope"
rope_theta = 500000.0
norm = "rmsnorm"
norm_eps = 1e-5
mlp = "swiglu"  # hidden 8/3 x 1024 rounded up to 2752
bias = False
tie_embeddings = False
dropout = 0.0
pad_vocab_to_multiple = 64  # GPT-2's 50257 -> 50304
dtype = "bfloat16"
# The 22 layers written out and nothing recomputed: on one TPU v5e at batch 4, 153.1 ms a step (MFU 65.0%,
# 10,735 MiB) against 166.7 ms (59.7%, 13,837 MiB) scanned with the matmuls' outputs saved; its compile
# takes 3-4 minutes there instead of 45 s (--compile_cache keeps it for the next start). At the batch of 8
# below: MFU 70.7%, 14.95 of the chip's 15.75 GiB; scanned, it does not fit.
scan_layers = False
remat_policy = "none"

batch_size = 8
gradient_accumulation_steps = 32  # 8 x 2048 x 32 = 524,288 tokens per step
learning_rate = 3e-4
max_iters = 20_000  # ~10.5B tokens
lr_decay_iters = 20_000
warmup_iters = 1000
min_lr = 3e-5
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 100
log_interval = 10
