# Multi-head attention (GPT-2): every query head has its own K/V head.
#
# One of four comparable variants (mha.py, gqa.py, mqa.py, mla.py) that set only the attention, and append its name
# to out_dir: the model size and token budget come from train.py's defaults (a CPU run of minutes on the embedded
# dataset) or from a size file stacked before them, so the four runs compare fairly and share one wandb group
# (train.py names it from the dataset and size, and each run from its variant):
#     for v in mha gqa mqa mla; do python train.py configs/$v.py || break; done   # out-mha .. out-mla
#     python compare.py
#     python train.py configs/kv_h200.py configs/mha.py                          # GPU-sized: out-kv-mha
# Overrides go anywhere (`configs/mha.py --n_layer=6`); a size file goes before the variant file, whose out_dir
# builds on the one before it.
attention = "mha"
out_dir = f"{out_dir}-mha"
