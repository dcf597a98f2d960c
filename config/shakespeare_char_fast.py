# The fastest way nanomax knows to the default run's validation loss (config/shakespeare_char.py:
# 1.716 after 2000 steps): the same data, size and batch, built Llama-style with the GPT-2
# speedruns' switches and trained with Muon, on a schedule that ends where the target is reached.
# docs/convergence.md's "What each change gives" table has each change's share.
out_dir = "out-shakespeare-char-fast"
dataset = "shakespeare_char"

n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0
scan_layers = False

# Llama-style: RoPE, RMSNorm, SwiGLU, 2 key/value heads for 4 query heads, no biases, untied output
pos_embedding = "rope"
norm = "rmsnorm"
mlp = "swiglu"
n_kv_head = 2
bias = False
tie_embeddings = False
# modded-nanogpt's: normalised queries and keys, blocks that start as the identity, capped logits
qk_norm = True
zero_init_proj = True
logit_softcap = 30.0

optimizer = "muon"  # the blocks' matrices; embeddings, head and norms keep AdamW
muon_learning_rate = 0.02
learning_rate = 2e-3
batch_size = 16
gradient_accumulation_steps = 1
max_iters = 400
lr_decay_iters = 400
warmup_iters = 50
min_lr = 2e-4
beta2 = 0.99

eval_interval = 100
eval_iters = 20
log_interval = 50
always_save_checkpoint = False
sample_tokens = 300
