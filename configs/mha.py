# Multi-head attention (GPT-2): every query head has its own K/V head.
#
# One of four comparable variants (mha.py, gqa.py, mqa.py, mla.py) that change only the attention: the model
# size and token budget come from train.py's defaults (a CPU run of minutes on the embedded dataset) or from a
# size file stacked before them, so the four runs compare fairly and share one wandb group (train.py names it
# from the dataset and size, and each run from its variant):
#     python train.py configs/mha.py --wandb_log=True            # CPU; likewise gqa.py, mqa.py, mla.py
#     python train.py configs/kv_h200.py configs/mha.py          # GPU-sized, long context
# Size overrides go BEFORE the variant file (arguments apply left to right, gqa.py and mla.py compute from n_head
# and n_embd, and a size set after them is refused):
#     python train.py --n_layer=6 configs/mha.py
attention = "mha"
n_kv_head = None  # the model sets n_head
out_dir = f"{out_dir}-mha"  # noqa: F821 (config files see the values set before them)
