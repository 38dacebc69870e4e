"""A random bf16 SmolLM2-1.7B-shaped Llama checkpoint (24 layers, 32 query and 32 KV heads, head dim 64, vocabulary
49152) saved to argv[1], built on the GPU (torch seed 0). Usage: python smollm2_random.py DIR"""
import sys

import torch
import transformers

torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                               num_attention_heads=32, num_key_value_heads=32, head_dim=64,
                               max_position_embeddings=140000, rope_theta=130000.0, tie_word_embeddings=True)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(sys.argv[1])
