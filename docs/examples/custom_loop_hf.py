"""A hand-written greedy decoding loop over a transformers model with ``KVPolicyCache``.

``generate()`` is not needed: call the model's forward with the cache, the 2-D padding mask and
the position ids yourself. The model's attention is kvpolicy's ``"kvpolicy"`` function, which
calls ``cache.attend`` (the same kernel as ``EvictingCache.attend``) with each layer's new keys,
values and queries and the padding of the new tokens. The cache evicts on the policy's
schedule; ``get_seq_length()`` keeps counting every token seen, so positions keep growing. Runs
offline on a tiny random Qwen3.
"""

import inspect

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvpolicy


def main() -> None:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )
    model = Qwen3ForCausalLM(config).eval()
    policy = kvpolicy.load_policy("snapkv", budget=64, recent=16, interval=16, window=16)
    cache = kvpolicy.KVPolicyCache(policy, model)  # switches the model to "kvpolicy" attention
    # The forward's cache argument: `cache` from transformers 5.24 on, `past_key_values` before.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    # Two prompts of different lengths, left-padded into one batch.
    prompts = [torch.randint(1, 512, (20,)), torch.randint(1, 512, (13,))]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = p
        mask[row, width - len(p) :] = 1

    generated = []
    with torch.no_grad():
        for _ in range(300):
            # Positions count real tokens only; padding positions are masked anyway.
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, cache.get_seq_length() :]
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_arg: cache})
            ids = out.logits[:, -1].argmax(-1, keepdim=True)  # feed only the new token next
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)  # 2-D mask over all tokens
            generated.append(ids)
    tokens = torch.cat(generated, dim=1)
    print(f"generated {tuple(tokens.shape)}; tokens seen: {cache.get_seq_length()}")
    for i, s in enumerate(cache.stats()):
        print(f"layer {i}: {s}")
    print(f"KV memory: {cache.memory_bytes():,} bytes")
    assert cache.get_seq_length() == width + 299
    assert all(s.slots_held <= policy.budget + policy.schedule.interval for s in cache.stats())


if __name__ == "__main__":
    main()
