# The default Shakespeare run (config/shakespeare_char.py) with a mixture of experts in every
# layer: 8 experts of half the MLP's width, 2 per token, so a token uses as many weights as the
# dense model's (822K active of 2.39M parameters); dispatch drops what exceeds 1.25x an expert's share.
out_dir = "out-shakespeare-char-moe"
dataset = "shakespeare_char"

n_layer = 4
n_head = 4
n_embd = 128
block_size = 128
dropout = 0.0
scan_layers = False

n_experts = 8
experts_per_token = 2
moe_hidden = 256  # 2 experts x 256 = the dense MLP's 512
capacity_factor = 1.25
router_aux_loss_coef = 0.01
router_z_loss_coef = 0.001

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
