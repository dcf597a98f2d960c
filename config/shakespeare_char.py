# A small character-level GPT on Shakespeare's plays: the default run, a few minutes on
# 2 CPU cores. For a GPU, scale it up like nanoGPT's baby GPT:
#   --n_layer=6 --n_head=6 --n_embd=384 --block_size=256 --batch_size=64 --dropout=0.2
out_dir = "out-shakespeare-char"
dataset = "shakespeare_char"

n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0
scan_layers = False  # at 4 layers, unrolled is ~16% faster on CPU and compiles as fast

batch_size = 16
gradient_accumulation_steps = 1
learning_rate = 2e-3  # small models tolerate a larger step
max_iters = 2000
lr_decay_iters = 2000
warmup_iters = 100
min_lr = 2e-4
beta2 = 0.99  # few tokens per step: average the second moment over more steps

eval_interval = 500
eval_iters = 20
log_interval = 100
always_save_checkpoint = False
sample_tokens = 300
