"""EvictingCache: append, evict and compact keep exactly the selected slots; padding; errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpolicy import EvictingCache, load_policy
from kvpolicy.slots import gather_slots

B, HKV, HQ, D = 2, 2, 4, 8


def _step_tensors(g, t=1, b=B):
    k = torch.randn(b, HKV, t, D, generator=g)
    v = torch.randn(b, HKV, t, D, generator=g)
    q = torch.randn(b, HQ, t, D, generator=g)
    return k, v, q


def _policy(name="snapkv", **kw):
    over = {"budget": 16, "recent": 4, "interval": 4, "window": 4}
    if name == "streamingllm":
        over = {"budget": 16, "recent": 12, "interval": 4}
    over.update(kw)
    return load_policy(name, **over)


@pytest.mark.parametrize("name", ["snapkv", "streamingllm", "vase-dkv", "vase-attnv", "rkv", "curdkv", "random"])
def test_eviction_keeps_exactly_the_selected_slots(name):
    """What the cache keeps at every eviction of every layer is ``Policy.select`` on the cache's own
    state, given the layer and the row's eviction count: stochastic policies included."""
    policy = _policy(name)
    cache = EvictingCache(policy, num_layers=2)
    g = torch.Generator().manual_seed(0)
    history = {i: ([], []) for i in range(2)}  # every key / value ever appended, per layer
    for step in range(40):
        expected = {}
        if cache.layers[0].eviction_due:
            for layer, state in enumerate(cache.layers):
                window, wvalid = state.window()
                expected[layer] = (
                    policy.select(
                        state.keys.clone(), state.values.clone(), window, slot_valid=state.valid,
                        query_valid=wvalid, positions=state.positions, layer_idx=layer, evictions=state.evictions,
                    ),
                    state.positions.clone(),
                )
        for layer in range(2):
            k, v, q = _step_tensors(g, t=10 if step == 0 else 1)
            state = cache.layers[layer]
            keys, values, valid = cache.step(layer, k, v, q)
            history[layer][0].append(k)
            history[layer][1].append(v)
            all_k = torch.cat(history[layer][0], dim=2)
            all_v = torch.cat(history[layer][1], dim=2)
            # Every held slot is the token at its recorded position, bit for bit.
            pos = state.positions
            assert bool(valid.all()) and bool((pos >= 0).all())
            idx = pos[..., None].expand(*pos.shape, D)
            assert torch.equal(keys, torch.gather(all_k, 2, idx))
            assert torch.equal(values, torch.gather(all_v, 2, idx))
            assert bool((pos[..., 1:] > pos[..., :-1]).all()), "slots stay in position order"
            if layer in expected:
                kept, before_pos = expected[layer]
                assert torch.equal(pos[..., :-1], torch.gather(before_pos, 2, kept))
            assert state.length <= policy.schedule.capacity
    stats = cache.stats()
    assert all(s.evictions > 0 and s.tokens_seen == 49 for s in stats)
    assert all(s.slots_held == cache.layers[0].length for s in stats)


def test_padding_is_never_stored_and_rows_are_packed():
    policy = _policy("snapkv")
    cache = EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(1)
    k, v, q = _step_tensors(g, t=12)
    token_valid = torch.ones(B, 12, dtype=torch.bool)
    token_valid[1, :5] = False  # left padding on row 1
    keys, _, valid = cache.step(0, k, v, q, token_valid)
    state = cache.layers[0]
    assert state.counts == [12, 7]
    assert valid.shape == (B, HKV, 12)
    assert valid[1, 0].tolist() == [True] * 7 + [False] * 5
    assert state.positions[1, 0].tolist() == list(range(7)) + [-1] * 5
    assert torch.equal(keys[1, :, :7], k[1, :, 5:])  # row 1's real tokens, moved to the front
    for _ in range(30):
        keys, values, valid = cache.step(0, *_step_tensors(g))
    assert state.stats.evictions > 0
    assert state.group.rows.tokens.tolist() == [42, 37]
    assert int(state.positions[1].max()) == 36
    # Each row holds exactly its count of valid slots.
    for row, count in enumerate(state.counts):
        assert valid[row].sum(-1).tolist() == [count] * HKV


@pytest.mark.parametrize("name", ["snapkv", "vase-dkv", "streamingllm", "rkv"])
@pytest.mark.parametrize("pad", [3, 5])
def test_a_padded_row_evicts_exactly_as_it_would_alone(name, pad):
    """Padding never counts: a left-padded row follows the schedule on its own real tokens."""
    policy = _policy(name)
    g = torch.Generator().manual_seed(7)
    prompt = _step_tensors(g, t=12)
    steps = [_step_tensors(g) for _ in range(40)]
    batch, alone = EvictingCache(policy, num_layers=1), EvictingCache(policy, num_layers=1)
    token_valid = torch.ones(B, 12, dtype=torch.bool)
    token_valid[1, :pad] = False
    batch.step(0, *prompt, token_valid)
    alone.step(0, *(t[1:, :, pad:] for t in prompt))
    for k, v, q in steps:
        kb, _, vb = batch.step(0, k, v, q)
        ka, _, _ = alone.step(0, k[1:], v[1:], q[1:])
        count = batch.layers[0].counts[1]
        assert count == alone.layers[0].counts[0]
        if not policy.stochastic:
            assert torch.equal(kb[1, :, :count], ka[0]), "row 1 holds the same slots as alone"
        assert bool(vb[1, :, :count].all()) and not bool(vb[1, :, count:].any())
    assert batch.layers[0].stats.evictions > alone.layers[0].stats.evictions  # row 0 evicts at other steps


def test_select_rows_reorders_every_layer():
    cache = EvictingCache(_policy("snapkv"), num_layers=2)
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        for layer in range(2):
            cache.step(layer, *_step_tensors(g))
    before = [(s.keys.clone(), s.positions.clone(), s.window()[0].clone()) for s in cache.layers]
    ptr = cache.layers[0].group.buffers.keys.data_ptr()
    cache.select_rows(torch.tensor([1, 0]))
    for s, (k, p, q) in zip(cache.layers, before, strict=True):
        assert torch.equal(s.keys, k.flip(0)) and torch.equal(s.positions, p.flip(0))
        assert torch.equal(s.window()[0], q.flip(0))
    assert cache.layers[0].group.buffers.keys.data_ptr() == ptr  # same batch size: in place
    cache.select_rows(torch.tensor([0, 0, 1, 1]))
    assert cache.layers[1].keys.shape[0] == 4 and len(cache.layers[1].counts) == 4
    cache.step(0, *_step_tensors(g, b=4))


@pytest.mark.parametrize("index", [torch.tensor([True, False]), torch.tensor([0.9, 0.2]), [True, False], [0.0, 1.0]],
                         ids=["bool-mask", "float-tensor", "bool-list", "float-list"])
def test_select_rows_refuses_what_is_not_row_numbers(index):
    """A mask ``[True, False]`` read as numbers would swap the rows, ``[0.9, 0.2]`` keep row 0
    twice: refused by name instead (``KVPolicyCache.batch_select_indices`` turns a mask into row
    numbers first, as ``DynamicCache`` indexes with one)."""
    cache = EvictingCache(_policy("snapkv"), num_layers=1)
    cache.step(0, *_step_tensors(torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="index must hold row numbers"):
        cache.select_rows(index)
    cache.select_rows([1, 0])


def test_memory_is_static_while_decoding():
    policy = _policy("vase-attnv", budget=32, recent=8, interval=8, window=8)
    cache = EvictingCache(policy, num_layers=3)
    g = torch.Generator().manual_seed(3)
    for layer in range(3):
        cache.step(layer, *_step_tensors(g, t=8))
    ptr, mem = cache.layers[0].group.buffers.keys.data_ptr(), cache.memory_bytes()
    for _ in range(300):
        for layer in range(3):
            cache.step(layer, *_step_tensors(g))
        assert cache.layers[0].group.buffers.keys.data_ptr() == ptr and cache.memory_bytes() == mem
    assert len({id(s.group) for s in cache.layers}) == 1, "layers of one shape share buffers"
    assert all(s.stats.evictions == (308 - 32) // 8 for s in cache.layers)


@pytest.mark.parametrize("name", ["snapkv", "dms"])
def test_stats_read_after_inference_mode(name):
    """A cache filled under torch.inference_mode (as the eval harness runs) still reports its
    stats and per-head counts outside it (regression: reading rows' counts wrote to them)."""
    policy = _policy(name) if name == "dms" else _policy(name, budget=32, recent=8, interval=8, window=8)
    cache = EvictingCache(policy, num_layers=2)
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for layer in range(2):
            cache.step(layer, *_step_tensors(g, t=8))
        for _ in range(40):
            for layer in range(2):
                cache.step(layer, *_step_tensors(g))
    stats = cache.stats()
    assert [s.tokens_seen for s in stats] == [48, 48]
    assert all(s.head_slots_held == int(cache.head_counts(i).sum()) for i, s in enumerate(stats))
    assert cache.held_bytes() <= cache.memory_bytes()


def test_shape_and_argument_errors():
    with pytest.raises(ValueError, match="num_layers"):
        EvictingCache("snapkv", num_layers=0)
    with pytest.raises(ValueError, match="layer_devices"):
        EvictingCache("snapkv", num_layers=2, layer_devices=["cpu"])
    cache = EvictingCache(_policy("snapkv"), num_layers=2)
    g = torch.Generator().manual_seed(4)
    with pytest.raises(IndexError):
        cache.step(2, *_step_tensors(g))
    k, v, q = _step_tensors(g)
    with pytest.raises(ValueError, match="queries"):
        cache.step(0, k, v)  # the policy reads a query window
    cache.step(0, k, v, q)
    k3, v3, q3 = _step_tensors(g, b=3)
    with pytest.raises(ValueError, match="do not match"):
        cache.step(0, k3, v3, q3)
    with pytest.raises(ValueError, match="1-D"):
        cache.select_rows(torch.zeros(2, 2, dtype=torch.long))
    # StreamingLLM reads no window: queries are optional.
    stream = EvictingCache(_policy("streamingllm"), num_layers=1)
    stream.step(0, k, v)
    stream.reset()
    assert stream.tokens_seen() == 0 and stream.layers[0].length == 0


@pytest.mark.parametrize("name", ["snapkv", "quest"])
def test_inputs_a_cache_cannot_serve_are_refused_before_anything_is_stored(name):
    """Found from outside: each of these used to fail deep inside torch (or write nothing
    sensible): keys, values and queries of mixed dtypes or devices; a step of no rows (after
    ``select_rows([])``); a forward in grad mode with inputs that require grad (``bmm(out=)``
    does not differentiate; select mode's summaries are written in place); a second turn
    outside ``torch.inference_mode()`` onto buffers made inside it. The cache is unchanged."""
    from kvpolicy.state import CacheStateError

    cache = EvictingCache(_policy(name), num_layers=1)
    g = torch.Generator().manual_seed(5)
    k, v, q = _step_tensors(g, t=20)
    with pytest.raises(ValueError, match=r"values are torch.float16 on cpu, keys torch.float32"):
        cache.attend(0, q, k, v.half())
    with pytest.raises(ValueError, match=r"queries are torch.float64 on cpu, keys torch.float32"):
        cache.attend(0, q.double(), k, v)
    with pytest.raises(ValueError, match=r"queries are torch.float32 on meta"):
        cache.attend(0, q.to("meta"), k, v)
    with pytest.raises(ValueError, match=r"keys are on the meta device"):
        cache.attend(0, *(x.to("meta") for x in (q, k, v)))
    with pytest.raises(ValueError, match="at least one row"):
        cache.attend(0, q[:0], k[:0], v[:0])
    with pytest.raises(RuntimeError, match=r"serve inference: run the forward under torch.no_grad"):
        cache.attend(0, q, k.requires_grad_(), v)
    assert cache.tokens_seen() == 0
    with torch.no_grad():  # the same tensors, grad off: served
        cache.attend(0, q, k, v)
    with torch.inference_mode():
        fresh = EvictingCache(_policy(name), num_layers=1)
        fresh.attend(0, q, k.detach(), v)
    with pytest.raises(CacheStateError, match=r"made under torch.inference_mode\(\)"):
        fresh.attend(0, *(x[:, :, :1] for x in (q, k.detach(), v)))
    with torch.inference_mode():
        fresh.attend(0, *(x[:, :, :1] for x in (q, k.detach(), v)))
    assert fresh.tokens_seen() == 21
    # Every other write outside inference_mode is refused by name too, before anything moves.
    with pytest.raises(CacheStateError, match=r"select rows under inference_mode too"):
        fresh.select_rows(torch.tensor([0]))
    if fresh.policy.mode == "evict":
        with torch.inference_mode():
            for _ in range(fresh.tokens_to_next_eviction() or 0):
                fresh.attend(0, *(x[:, :, :1] for x in (q, k.detach(), v)))
        with pytest.raises(CacheStateError, match=r"evict under inference_mode too"):
            fresh.evict_due()
        with torch.inference_mode():
            assert fresh.evict_due() > 0
    cache.select_rows(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="at least one row"):
        cache.attend(0, *(x[:0, :, :1] for x in (q, k.detach(), v)))


@pytest.mark.parametrize("name", ["snapkv", "quest", "h2o", "ada-snapkv"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool, torch.complex64, torch.float8_e4m3fn])
def test_keys_of_a_dtype_the_cache_cannot_serve_are_refused_by_name_before_anything_is_stored(name, dtype):
    """Integer, bool, complex or float8 keys reached the attention (or the first eviction) and
    failed there with torch's own error ("expected scalar type Float but found Long"), after the
    first step had allocated the layer's buffers in that dtype: every later float step was then
    refused as not matching the cache. Now they are refused by name, and nothing is stored."""
    cache = EvictingCache(_policy(name), num_layers=1)
    g = torch.Generator().manual_seed(6)
    k, v, q = _step_tensors(g, t=20)
    with pytest.raises(ValueError, match=rf"^keys must be float32, float16, bfloat16 or float64, got {dtype}$"):
        cache.attend(0, q.to(dtype), k.to(dtype), v.to(dtype))
    assert cache.tokens_seen() == 0 and not cache.layers[0].is_allocated
    out = cache.attend(0, q, k, v)  # the cache serves float inputs as a fresh one
    assert torch.equal(out, EvictingCache(_policy(name), num_layers=1).attend(0, q, k, v))
    with pytest.raises(ValueError, match=rf"^keys must be float32, float16, bfloat16 or float64, got {dtype}$"):
        cache.attend(0, *(x[:, :, :1].to(dtype) for x in (q, k, v)))
    with pytest.raises(TypeError, match=rf"^keys must be float32, float16, bfloat16 or float64, got {dtype}$"):
        _policy(name).select_heads(k.to(dtype), v.to(dtype), q.to(dtype))  # float64 is served: the message says so


@given(
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=3), n=st.integers(1, 12), d=st.integers(1, 5),
    k=st.integers(1, 6), spare=st.integers(0, 4), seed=st.integers(0, 1000),
)
def test_gather_slots_equals_torch_gather_on_buffer_views(lead, n, d, k, spare, seed):
    """The fast slot gather equals ``torch.gather`` on views of a larger buffer (slots past N in
    the storage, rows selected by a slice), and on a layout it cannot take as rows."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(*lead, n + spare, d, generator=g)
    x = buf[..., :n, :]  # a view, as the cache's held slots are
    index = torch.randint(0, n, (*lead, k), generator=g)
    want = torch.gather(x, -2, index[..., None].expand(*index.shape, d))
    assert torch.equal(gather_slots(x, index), want)
    y = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # slots are not rows of D: the fallback
    assert torch.equal(gather_slots(y, index), want)


@pytest.mark.parametrize("name", ["snapkv", "vase-attnv"])
def test_the_documented_select_recipe_keeps_what_the_cache_keeps_for_uneven_rows(name):
    """custom-loops.md, 'Only the algorithm': ``select`` on a cache's state keeps what the cache
    keeps. Rows holding different counts are packed from slot 0, so a shorter row's padding sits
    where ``select`` reads the recent buffer: it kept padding and dropped the row's newest slots
    (found from outside). The batched call now refuses it; the per-row recipe agrees."""
    policy = _policy(name, seed=2)
    cache = EvictingCache(policy, num_layers=1)
    g = torch.Generator().manual_seed(6)
    k, v, q = _step_tensors(g, t=15)
    valid = torch.ones(B, 15, dtype=torch.bool)
    valid[0, :3] = False  # row 0 holds 3 slots fewer
    cache.step(0, k, v, q, token_valid=valid)
    checked = 0
    for _ in range(30):
        cache.step(0, *_step_tensors(g))
        view = cache.layers[0]
        if not view.eviction_due:
            continue
        window, window_valid = view.window()
        if len(set(view.counts)) > 1:
            with pytest.raises(ValueError, match=r"slot_valid: row \d has padding after a real slot"):
                policy.select(view.keys, view.values, window, slot_valid=view.valid, query_valid=window_valid,
                              positions=view.positions, layer_idx=0, evictions=view.evictions, streams=view.streams,
                              seed=cache.seed)
        due = view.group.due.clone()  # [B]: the rows due
        want = []
        for r, n in enumerate(view.counts):
            kept = policy.select(
                view.keys[r : r + 1, :, :n], view.values[r : r + 1, :, :n], window[r : r + 1],
                query_valid=window_valid[r : r + 1], positions=view.positions[r : r + 1, :, :n],
                layer_idx=0, evictions=view.evictions[r : r + 1], streams=view.streams[r : r + 1], seed=cache.seed,
            )
            want.append(view.positions[r : r + 1, :, :n].gather(-1, kept)[0])
        cache.evict_due()
        for r in range(B):
            if due[r]:
                assert torch.equal(view.positions[r, :, : int(view.counts[r])], want[r])
                checked += 1
    assert checked >= 4
