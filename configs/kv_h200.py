# GPU size for comparing the attention variants where the KV cache matters: 16 heads of 64 dims and a 2048
# context, so MHA's cache (2 x 16 x 64 numbers per token per layer) is 4x GQA's, 16x MQA's and ~7x MLA's
# (4 x 64 + 32). Stack a variant file after it (it appends its name to out_dir: out-kv-mha .. out-kv-mla); the
# four runs share one wandb group and token budget:
#     for v in mha gqa mqa mla; do python train.py configs/kv_h200.py configs/$v.py || break; done
#     python compare.py out-kv-*
out_dir = "out-kv"
dataset = "fineweb_edu"
wandb_group = "kv-h200"
n_layer = 12
n_head = 16
n_embd = 1024
block_size = 2048
bias = False
pos_embedding = "rope"
dropout = 0.0
batch_size = 16
gradient_accumulation_steps = 8  # 16 x 2048 x 8 = 262k tokens per iteration
learning_rate = 6e-4
min_lr = 6e-5
beta2 = 0.95
warmup_iters = 500
max_iters = 10000
eval_interval = 500
eval_iters = 50
log_interval = 10
compile = True
