# The shape of the fastest published small-model training run on one TPU v5e we know of (issue 66:
# 148,829 tok/s, a nanochat-style model in plain JAX): 8 layers 1024 wide, 4 query heads of 256
# sharing one key/value head (multi-query), SwiGLU 3072 wide, RoPE, RMSNorm, QK-norm, logits
# soft-capped at 15, an untied 32,768-token vocabulary, 2048-token rows, 16 micro-batches of 4.
# 163,595,264 parameters. Heads of 256 fill two of the v5e's 128-wide matmul tiles.
#   python bench.py config/llama_164m_mqa.py        (random tokens: no dataset needed)
#   python train.py config/llama_164m_mqa.py
# Data: FineWeb-Edu in a 32,768-token vocabulary (GPT-2's 50,257 would make it a 180M model):
#   python data/text/train_tokenizer.py --input_dir=<FineWeb-Edu parquet shards> --vocab_size=32768 \
#     --out_dir=data/tokenizer_32k
#   python data/fineweb/prepare.py --tokenizer=data/tokenizer_32k --out_dir=data/fineweb_edu_10bt_32k
out_dir = "out-llama-164m-mqa"
dataset = "fineweb_edu_10bt_32k"
vocab_size = 32768  # the tokenizer's (checked against the dataset's meta.json when training)

n_layer = 8
n_head = 4
n_kv_head = 1  # multi-query attention
n_embd = 1024  # head size 256
block_size = 2048
pos_embedding = "rope"
rope_theta = 500000.0
norm = "rmsnorm"
norm_eps = 1e-5
qk_norm = True
mlp = "swiglu"
mlp_hidden = 3072
logit_softcap = 15.0
bias = False
tie_embeddings = False
dropout = 0.0
pad_vocab_to_multiple = 64  # 32768 is a multiple already
dtype = "bfloat16"
# Nothing recomputed: at 4 x 2048 tokens a micro-step every activation fits (the step needs 7.2 GiB), and
# a v5e step then takes 796 ms against 840 with the matmuls' outputs kept (bench/NOTES.md).
remat_policy = "none"
# Its 8 layers written out rather than scanned: a v5e step then has no slicing of stacked activations,
# 874 ms against 988, for a compile of 71-84 s.
scan_layers = False

batch_size = 4
gradient_accumulation_steps = 16  # 4 x 2048 x 16 = 131,072 tokens per step
learning_rate = 3e-4
max_iters = 20_000  # ~2.6B tokens
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
