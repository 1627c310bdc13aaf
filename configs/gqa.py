# Grouped-query attention (Ainslie et al. 2023; Llama 2/3): groups of query heads share one K/V head. model.GPTConfig
# gives n_kv_head = n_head // 4 unless it is set, so the KV cache is 4x smaller than MHA's. See configs/mha.py for
# how the four variants are run and compared.
#     python train.py configs/gqa.py
#     python train.py configs/kv_h200.py configs/gqa.py
attention = "gqa"
out_dir = f"{out_dir}-gqa"
