# Multi-head latent attention (DeepSeek-V2, 2024): K/V are compressed into one latent c_kv per token plus a small
# RoPE key shared by all heads; the cache holds kv_lora_rank + qk_rope_head_dim numbers per token and layer,
# whatever the head count. model.GPTConfig sets the dims left at 0 by DeepSeek-V2's ratios to the head dim
# h = n_embd / n_head (there h = 128): kv_lora_rank 4h, qk_rope_head_dim h/2, qk_nope_head_dim = v_head_dim = h.
# MLA has somewhat more parameters than MHA at the same width (the down/up projections); the model line and
# metrics.jsonl's `params` show the counts. See configs/mha.py for how the four variants are run and compared.
#     python train.py configs/mla.py
#     python train.py configs/kv_h200.py configs/mla.py
attention = "mla"
out_dir = f"{out_dir}-mla"
