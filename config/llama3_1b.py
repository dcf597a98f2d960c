# Llama-3.2-1B's shapes (16 layers, 2048 wide, 32 query heads sharing 8 key/value heads,
# SwiGLU 8192 wide, RoPE base 500000, RMSNorm, no biases, tied embeddings: 1.24B parameters),
# in bfloat16 with rematerialization, FSDP over every device. For compiling ahead of time and
# benchmarking a modern 1B model, e.g.
#   python compile_aot.py config/llama3_1b.py --topology=v5p-64
# To train on text, tokenize it with Llama 3's tokenizer (128,256 tokens: uint32 token files):
#   python data/text/prepare.py --input_dir=my_texts --out_dir=data/mine --tokenizer=/path/to/Llama-3.2-1B
# and add --init_from=/path/to/Llama-3.2-1B (or meta-llama/Llama-3.2-1B) to fine-tune its weights:
# its config.json then also sets Llama 3.2's long-context RoPE scaling (rope_scaling='llama3').
out_dir = "out-llama3-1b"
dataset = "mine"
vocab_size = 128256

n_layer = 16
n_head = 32
n_kv_head = 8
n_embd = 2048
block_size = 8192
dropout = 0.0
pos_embedding = "rope"
rope_theta = 500000.0
norm = "rmsnorm"
norm_eps = 1e-5
mlp = "swiglu"
mlp_hidden = 8192
bias = False
tie_embeddings = True
dtype = "bfloat16"
remat_policy = "full"  # 8192-token rows: keep only each layer's input for the backward pass

mesh_data = 1
mesh_fsdp = -1
batch_size = 64  # sequences over all devices; 64 x 8192 x 8 micro-steps = 4.2M tokens per step
gradient_accumulation_steps = 8
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
