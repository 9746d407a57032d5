"""A small pure-PyTorch transformer whose attention layers call ``EvictingCache.attend``.

No transformers: each attention layer computes post-RoPE queries/keys and hands the new keys,
values and queries to the cache, which evicts what is due, appends them and attends over the
layer's slots with kvpolicy's kernel. Run it as a script: it decodes 400 tokens greedily with a
budget of 64 slots per layer, then replays them with the layers running their own attention
over ``EvictingCache.step``'s slots, and checks that both give the same logits.
"""

import torch
import torch.nn.functional as F
from torch import nn

import kvpolicy


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x [B, H, T, D]`` at integer ``positions [T]``."""
    d = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, layer_idx: int) -> None:
        super().__init__()
        self.hq, self.hkv, self.d, self.layer_idx = n_heads, n_kv_heads, dim // n_heads, layer_idx
        self.q = nn.Linear(dim, n_heads * self.d, bias=False)
        self.kv = nn.Linear(dim, 2 * n_kv_heads * self.d, bias=False)
        self.o = nn.Linear(n_heads * self.d, dim, bias=False)
        self.own_attention = False  # True: run our own attention over cache.step's slots

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: kvpolicy.EvictingCache) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.hq, self.d).transpose(1, 2)  # [B, Hq, T, D]
        k, v = self.kv(x).view(b, t, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)  # 2 x [B, Hkv, T, D]
        q, k = rope(q, positions), rope(k, positions)
        if self.own_attention:
            out = own_attention(q, *cache.step(self.layer_idx, k, v, q))
        else:
            # Evict what is due, append k/v, record q for the policy's scorers, attend: [B, Hq, T, D].
            out = cache.attend(self.layer_idx, q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


def own_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Your own attention over the slots ``EvictingCache.step`` returns: keys/values
    ``[B, Hkv, L, D]`` and their validity ``[B, Hkv, L]``.

    Causality inside a multi-token chunk is by token order; for rows without padding (here)
    the chunk's tokens are the last ``T`` slots. For padded batches use ``cache.attend``, which
    builds the right mask for every row.
    """
    t, length = q.shape[2], keys.shape[2]
    causal = torch.arange(length)[None, :] <= (length - t) + torch.arange(t)[:, None]  # [T, L]
    mask = valid[:, :, None, :] & causal  # [B, Hkv, T, L]
    g = q.shape[1] // keys.shape[1]  # query head h*g + j reads KV head h
    return F.scaled_dot_product_attention(
        q, keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1), attn_mask=mask.repeat_interleave(g, 1)
    )


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.RMSNorm(dim), "attn": Attention(dim, heads, kv_heads, i),
                           "mlp": nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                                nn.Linear(4 * dim, dim))})
            for i in range(layers)
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: kvpolicy.EvictingCache) -> torch.Tensor:
        x = self.embed(ids)
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm"](x), positions, cache)
            x = x + blk["mlp"](x)
        return self.head(x)


def decode(model: TinyLM, cache: kvpolicy.EvictingCache, prompt: torch.Tensor, steps: int, forced=None):
    """Greedy decoding (or, with ``forced`` tokens, teacher forcing); returns tokens and logits."""
    n = prompt.shape[1]
    logits = model(prompt, torch.arange(n), cache)[:, -1]  # prefill: never evicts
    tokens, all_logits = [], [logits]
    for step in range(steps):
        tokens.append(int(logits[0].argmax()) if forced is None else forced[step])
        pos = torch.tensor([n + step])  # RoPE positions keep growing with tokens seen
        logits = model(torch.tensor([[tokens[-1]]]), pos, cache)[:, -1]
        all_logits.append(logits)
    return tokens, torch.cat(all_logits)


def main() -> None:
    torch.manual_seed(0)
    model = TinyLM().eval()
    policy = kvpolicy.load_policy("vase-attnv", budget=64, recent=16, interval=16, window=16)
    cache = kvpolicy.EvictingCache(policy, num_layers=len(model.blocks))
    prompt = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        tokens, logits = decode(model, cache, prompt, 400)
    stats = cache.stats()
    print(f"generated {len(tokens)} tokens; per layer: {stats[0]}")
    print(f"KV memory: {cache.memory_bytes():,} bytes (static after the first eviction)")
    assert all(s.slots_held <= policy.budget + policy.schedule.interval for s in stats)
    assert all(s.evictions > 0 for s in stats)

    # The same tokens through cache.step and our own attention: the same evictions, the same logits.
    for blk in model.blocks:
        blk["attn"].own_attention = True
    with torch.no_grad():
        _, replayed = decode(model, kvpolicy.EvictingCache(policy, len(model.blocks)), prompt, 400, tokens)
    print(f"own attention over cache.step: max logit difference {float((logits - replayed).abs().max()):.1e}")
    assert torch.allclose(logits, replayed, atol=1e-4)


if __name__ == "__main__":
    main()
