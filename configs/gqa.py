# Grouped-query attention (Ainslie et al. 2023; Llama 2/3): n_head query heads share n_head / 4 K/V heads, so
# the KV cache is 4x smaller than MHA's. See configs/mha.py for how the four variants are run and compared.
#     python train.py configs/gqa.py
#     python train.py configs/kv_h200.py configs/gqa.py
attention = "gqa"
n_kv_head = max(1, n_head // 4)  # noqa: F821 (config files see the values set before them)
out_dir = f"{out_dir}-gqa"  # noqa: F821
