# Multi-query attention (Shazeer 2019; PaLM): every query head shares one K/V head, the smallest KV cache of the GQA
# family. See configs/mha.py for how the four variants are run and compared.
#     python train.py configs/mqa.py
#     python train.py configs/kv_h200.py configs/mqa.py
attention = "mqa"
out_dir = f"{out_dir}-mqa"
