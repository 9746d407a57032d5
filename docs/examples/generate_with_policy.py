"""Decode with a kvpolicy cache inside Hugging Face ``generate()``.

A tiny randomly initialised Qwen3 keeps the example offline and fast; any decoder model with full
attention (Llama, Mistral, Qwen2, Qwen3) works the same way.
"""

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvpolicy

torch.manual_seed(0)
config = Qwen3Config(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
)
model = Qwen3ForCausalLM(config).eval()

policy = kvpolicy.load_policy("vase-attnv", budget=128)
cache = kvpolicy.KVPolicyCache(policy, model)  # also switches the model to kvpolicy attention

prompt = torch.randint(0, 512, (1, 40))
out = model.generate(
    input_ids=prompt,
    attention_mask=torch.ones_like(prompt),
    past_key_values=cache,  # named `cache` from transformers 5.24 on; both work
    max_new_tokens=300,
    do_sample=False,
)
print(out.shape)  # 40 prompt + 300 new tokens
stats = cache.stats()[0]
print(stats)  # evictions, tokens seen, slots held (between budget and budget + interval)
print(f"KV bytes: {cache.memory_bytes():,}")
assert stats.slots_held <= policy.budget + policy.schedule.interval
