# Mixtral-8x7B's shapes (32 layers, 4096 wide, 32 query heads sharing 8 key/value heads, 8 SwiGLU
# experts 14336 wide of which each token uses 2, RoPE base 1e6, RMSNorm, no biases, untied output:
# 46.7B parameters, 12.9B active), in bfloat16 with rematerialization, for compiling ahead of time:
#   python compile_aot.py config/mixtral_8x7b.py --topology=v5p-128
# Experts split 8 ways over `expert`, and each over `fsdp` within; the batch over both.
out_dir = "out-mixtral-8x7b"
dataset = "mine"
vocab_size = 32000

n_layer = 32
n_head = 32
n_kv_head = 8
n_embd = 4096
block_size = 4096
dropout = 0.0
pos_embedding = "rope"
rope_theta = 1_000_000.0
norm = "rmsnorm"
norm_eps = 1e-5
mlp = "swiglu"
mlp_hidden = 14336
bias = False
tie_embeddings = False
n_experts = 8
experts_per_token = 2
capacity_factor = 1.25
dtype = "bfloat16"
remat_policy = "full"

mesh_data = 1
mesh_expert = 8
mesh_fsdp = -1
batch_size = 64  # sequences over all devices; 64 x 4096 x 4 micro-steps = 1M tokens per step
gradient_accumulation_steps = 4
learning_rate = 3e-4
max_iters = 100_000
lr_decay_iters = 100_000
warmup_iters = 2000
min_lr = 3e-5
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

eval_interval = 1000
eval_iters = 100
log_interval = 10
