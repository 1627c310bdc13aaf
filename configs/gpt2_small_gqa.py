# A GPT-2-small-sized model (12 layers, 12 heads, 768 wide, 1024 context) with grouped-query attention
# (3 K/V heads: model.GPTConfig's groups of 4), trained on the Triton kernels with torch.compile. ~0.5M tokens per
# iteration.
#     python -m data.prepare fineweb_edu --max_docs=2000000       # once, needs the network (~2B tokens)
#     python train.py configs/gpt2_small_gqa.py                  # one GPU
#     torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_small_gqa.py
#     python train.py configs/gpt2_small_gqa.py --dataset=pydoc --max_iters=200   # offline smoke run
out_dir = "out-gpt2-small-gqa"
dataset = "fineweb_edu"
wandb_group = "gpt2-small"
wandb_run_name = "gpt2-small-gqa"
n_layer = 12
n_head = 12
n_embd = 768
block_size = 1024
attention = "gqa"
bias = False
pos_embedding = "rope"
dropout = 0.0
batch_size = 32
gradient_accumulation_steps = 16  # global: 16 micro-steps on one GPU, 2 per GPU on eight
learning_rate = 6e-4
min_lr = 6e-5
beta2 = 0.95
warmup_iters = 700
max_iters = 20000
eval_interval = 500
eval_iters = 100
log_interval = 10
compile = True
