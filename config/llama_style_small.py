# config/shakespeare_char.py's model, rebuilt the way Llama builds its decoders: rotary
# positions, RMSNorm, a SwiGLU MLP, grouped-query attention (2 key/value heads serve the 4
# query heads, halving the KV cache), no biases, a separate output layer. Same size, data,
# schedule and steps as the default run, so the two loss curves compare directly:
#   python train.py config/llama_style_small.py
#   python plot.py out-shakespeare-char out-llama-style-small
out_dir = "out-llama-style-small"
dataset = "shakespeare_char"

n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
block_size = 128
dropout = 0.0
pos_embedding = "rope"
rope_theta = 10000.0
norm = "rmsnorm"
mlp = "swiglu"  # hidden size 8/3 x 128 rounded up to 384: about the parameters of GELU's 512
bias = False
tie_embeddings = False

batch_size = 16
gradient_accumulation_steps = 1
learning_rate = 2e-3
max_iters = 2000
lr_decay_iters = 2000
warmup_iters = 100
min_lr = 2e-4
beta2 = 0.99

eval_interval = 500
eval_iters = 20
log_interval = 100
always_save_checkpoint = False
sample_tokens = 300
