# The offline chat set (data/chat/make_tasks.py: capitalize a three-letter word, add two digits), learned
# from scratch by a tiny model in a minute or two on 2 CPU cores; then ask it through serve.py:
#   python data/chat/make_tasks.py
#   python data/chat/prepare.py --input=data/chat/tasks/train.jsonl --val_input=data/chat/tasks/val.jsonl \
#       --tokenizer=data/chat/tasks/tokenizer --block_size=128 --out_dir=data/chat_tasks
#   python train.py config/sft_tasks.py
#   python serve.py --out_dir=out-sft-tasks
# The loss is over the assistant's tokens only; packing puts two or three conversations in a row.
out_dir = "out-sft-tasks"
dataset = "chat_tasks"
packing = True

n_layer = 2
n_head = 4
n_embd = 64
# RoPE's relative positions suit the task: each answer's letters sit at a fixed distance from the
# question's. (Llama's rmsnorm + swiglu, which export_hf.py could export, learned it ~2x slower here.)
pos_embedding = "rope"
block_size = 128  # as prepare.py's --block_size
scan_layers = False

batch_size = 16
learning_rate = 5e-3
max_iters = 800  # ~10 epochs of the 6,000 conversations (~2,100 packed rows)
lr_decay_iters = 800
warmup_iters = 30
min_lr = 5e-4
weight_decay = 0.0

eval_interval = 200
eval_iters = 10
log_interval = 50
