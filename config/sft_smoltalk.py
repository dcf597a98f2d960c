# Fine-tune a pretrained model for chat on HuggingFaceTB/smol-smoltalk, the assistant's tokens only, packed:
#   python data/chat/prepare.py --hub=HuggingFaceTB/smol-smoltalk --tokenizer=MODEL_DIR \
#       --block_size=2048 --out_dir=data/smol_smoltalk
#   python train.py config/sft_smoltalk.py --init_from=MODEL_DIR
# MODEL_DIR: the model's Hugging Face folder (config.json, model.safetensors, tokenizer.json with its chat
# template), e.g. a download of HuggingFaceTB/SmolLM2-135M-Instruct's; a hub name works when online.
# Its config.json sets the model keys. The template is the tokenizer's: prepare.py, serve.py and
# sample.py --chat render conversations alike, and export_hf.py keeps it.
init_from = "HuggingFaceTB/SmolLM2-135M"
out_dir = "out-sft-smoltalk"
dataset = "smol_smoltalk"
packing = True
block_size = 2048  # as prepare.py's --block_size
dtype = "bfloat16"

# Fine-tuning: a small step, a short warm-up, decay to a tenth, no weight decay, one to three epochs:
# an epoch is (packed rows) / (batch_size x gradient_accumulation_steps) steps, and train.py's start-up
# line "data: ..." gives the rows.
batch_size = 16
gradient_accumulation_steps = 4
learning_rate = 5e-5
min_lr = 5e-6
warmup_iters = 50
max_iters = 2300
lr_decay_iters = 2300
weight_decay = 0.0
grad_clip = 1.0

eval_interval = 250
eval_iters = 20
log_interval = 10
always_save_checkpoint = False
