"""kvpolicy.vllm's block layouts, paged gather and compaction on tensors laid out as vLLM 0.32's
caches: no vLLM needed.

The reference writers below place each key and value element by the layout's definition (the
physical axis order of ``[L, B, H, N, C]``; the CPU backend's transposed key pages), one element
at a time, independently of the views ``BlockLayout.split`` takes. The engine tests
(tests/engine_vllm/test_config.py) check the same layouts against vLLM's own code.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.vllm.lanes import LaneColumns, Lanes, LaneStep, plan_attention
from kvpolicy.vllm.layout import STRIDE_ORDERS, BlockLayout, LayoutError, layer_views
from kvpolicy.vllm.paged import compact, gather_layers, gather_paged, in_place, slot_address

CPU = "LBHNC"


def write_cell(buffer, layout, sizes, layer, slot, key, value):
    """``cells`` interior: key then value in the (layer, block, head, slot) cell; the flat buffer
    holds the axes in the layout's physical order."""
    order = STRIDE_ORDERS[layout]
    phys = buffer[: torch.Size(sizes).numel()].view([sizes[a] for a in order])
    bs, d = sizes[3], key.shape[-1]
    block, off = divmod(slot, bs)
    for head in range(key.shape[0]):
        for c in range(2 * d):
            logical = (layer, block, head, off, c)
            phys[tuple(logical[a] for a in order)] = key[head, c] if c < d else value[head, c - d]


def write_cpu_page(buffer, sizes, layer, slot, key, value):
    """``cpu_pages`` interior (LBHNC): per (layer, block, head) page of ``N * 2D`` elements, the
    keys transposed (element d of offset o at ``d * N + o``), then the values (``N * D + o * D + d``)."""
    _, nb, h, bs, c = sizes
    d = c // 2
    pages = buffer[: torch.Size(sizes).numel()].view(-1, h, bs * c)
    block, off = divmod(slot, bs)
    for head in range(h):
        page = pages[layer * nb + block, head]
        for i in range(d):
            page[i * bs + off] = key[head, i]
            page[bs * d + off * d + i] = value[head, i]


def _data(layers, tokens, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, tokens, h, d, generator=g), torch.randn(layers, tokens, h, d, generator=g)


def _build(layout, interior, sizes, tables, keys, values):
    """A buffer in ``layout`` whose every slot holds garbage (the same garbage slot for slot in any
    layout), with row ``r``'s tokens then written into its blocks by the reference writer."""
    lyr, nb, h, bs, c = sizes
    buffer = torch.zeros(torch.Size(sizes).numel())
    bl = BlockLayout(layout, interior, c // 2)
    kv = [bl.split(v) for v in layer_views(buffer, layout, lyr, nb, h, bs, c)]
    g = torch.Generator().manual_seed(100)
    for k_view, v_view in kv:
        k_view.copy_(torch.randn(nb, bs, h, c // 2, generator=g))
        v_view.copy_(torch.randn(nb, bs, h, c // 2, generator=g))
    for layer in range(lyr):
        for r, table in enumerate(tables):
            for s in range(keys.shape[2]):
                slot = int(table[s // bs]) * bs + s % bs
                if interior == "cells":
                    write_cell(buffer, layout, sizes, layer, slot, keys[layer, r, s], values[layer, r, s])
                else:
                    write_cpu_page(buffer, sizes, layer, slot, keys[layer, r, s], values[layer, r, s])
    return buffer, kv


def test_slot_address():
    blocks, offs = slot_address(torch.tensor([[5, 1, 3], [0, 2, 7]]), 7, 3)
    assert blocks.tolist() == [[5, 5, 5, 1, 1, 1, 3], [0, 0, 0, 2, 2, 2, 7]]
    assert offs.tolist() == [[0, 1, 2, 0, 1, 2, 0]] * 2


def test_the_layouts_are_vllm_0_32s():
    # Every KVCacheLayout member, outermost axis first (vllm/v1/kv_cache_layout.py; the engine
    # tests compare with the enum itself).
    assert {n: "".join("LBHNC"[a] for a in o) for n, o in STRIDE_ORDERS.items()} == {n: n for n in STRIDE_ORDERS}
    assert len(STRIDE_ORDERS) == 6


@pytest.mark.parametrize(("layout", "interior"), [(name, "cells") for name in STRIDE_ORDERS] + [(CPU, "cpu_pages")])
def test_gather_reads_what_the_reference_writer_wrote(layout, interior):
    sizes, tables = (2, 8, 2, 4, 6), torch.tensor([[6, 2, 4], [1, 3, 7]])
    keys, values = _data(2, 10, 2, 3, 0)
    keys, values = keys[:, None].expand(2, 2, 10, 2, 3).clone(), values[:, None].expand(2, 2, 10, 2, 3).clone()
    keys[:, 1] += 1  # the two rows differ
    _, kv = _build(layout, interior, sizes, tables, keys, values)
    blocks, offs = slot_address(tables, 10, 4)
    for layer in range(2):
        k, v = gather_paged(kv[layer], blocks, offs)
        assert k.shape == (2, 2, 10, 3)
        assert torch.equal(k, keys[layer].transpose(1, 2)) and torch.equal(v, values[layer].transpose(1, 2))
    # every layer at once, each written into one tensor; values only when asked for
    stacked_keys, stacked_values = gather_layers(kv, blocks, offs)
    assert stacked_values is not None and stacked_keys.shape == (2, 2, 2, 10, 3)
    assert torch.equal(stacked_keys, keys.transpose(2, 3)) and torch.equal(stacked_values, values.transpose(2, 3))
    only_keys, none = gather_layers(kv, blocks, offs, values=False)
    assert none is None and torch.equal(only_keys, stacked_keys)


@pytest.mark.parametrize("layout", list(STRIDE_ORDERS))
def test_compaction_in_every_layout_equals_compaction_in_the_cpu_layout(layout):
    """Two requests, three layers, per-head kept sets: after compaction every slot of every block
    (the requests' and the others', every layer's) holds what the CPU layout's compaction leaves."""
    lyr, nb, h, bs, d, t, k = 3, 10, 2, 4, 3, 11, 6
    sizes = (lyr, nb, h, bs, 2 * d)
    tables = torch.tensor([[6, 2, 9], [1, 3, 7]])
    g = torch.Generator().manual_seed(7)
    keys, values = torch.randn(lyr, 2, t, h, d, generator=g), torch.randn(lyr, 2, t, h, d, generator=g)
    kept = torch.rand(lyr, 2, h, t, generator=g).argsort(-1)[..., :k].sort(-1).values  # [Lyr, R, Hkv, K]
    every = torch.arange(nb)[None]  # one "row" holding every block: reads the whole cache
    spare = torch.tensor([0, 4, 5, 8])  # the blocks no request owns
    results = []
    for lay, interior in ((layout, "cells"), (CPU, "cpu_pages")):
        _, kv = _build(lay, interior, sizes, tables, keys, values)
        blocks, offs = slot_address(tables, t, bs)
        gathered = [gather_paged(x, blocks, offs) for x in kv]
        before = [gather_paged(x, *slot_address(every, nb * bs, bs)) for x in kv]
        compact(kv, tables, gathered, kept, bs)
        after = [gather_paged(x, *slot_address(every, nb * bs, bs)) for x in kv]
        results.append((before, after, kv))
    (before_l, after_l, kv_l), (before_c, after_c, _) = results
    for layer in range(lyr):
        for a, b in zip(after_l[layer], after_c[layer], strict=True):
            assert torch.equal(a, b)  # slot for slot, the whole cache
        # and it is the compaction asked for: kept slots first, in order, per head
        k2, v2 = gather_paged(kv_l[layer], *slot_address(tables, k, bs))
        for r in range(2):
            for head in range(h):
                assert torch.equal(k2[r, head], keys[layer, r, kept[layer, r, head], head])
                assert torch.equal(v2[r, head], values[layer, r, kept[layer, r, head], head])
        # blocks outside the tables are not written
        for x, y in zip(before_l[layer], after_l[layer], strict=True):
            slots = (spare[:, None] * bs + torch.arange(bs)).flatten()
            assert torch.equal(x[0, :, slots], y[0, :, slots])


def test_layout_refusals():
    with pytest.raises(LayoutError, match="unknown KV cache layout 'NHD'"):
        BlockLayout("NHD", "cells", 64)
    with pytest.raises(LayoutError, match="need layout LBHNC"):
        BlockLayout("LBNHC", "cpu_pages", 64)
    with pytest.raises(LayoutError, match="not key \\+ value of head size 64"):
        BlockLayout(CPU, "cells", 64).split(torch.zeros(2, 2, 4, 96))
    with pytest.raises(LayoutError, match=r"\[blocks, kv_heads, block_size, content\]"):
        BlockLayout(CPU, "cells", 2).split(torch.zeros(2, 4, 4))
    # a CPU page needs its [N, C] contiguous: a layer view of an interleaved layout is refused
    view = layer_views(torch.zeros(2 * 2 * 2 * 4 * 6), "LBNHC", 2, 2, 2, 4, 6)[0]
    with pytest.raises(LayoutError, match="contiguous"):
        BlockLayout(CPU, "cpu_pages", 3).split(view)


def test_backend_names_pick_the_interior():
    assert BlockLayout.for_backend("CPU_ATTN", CPU, 64).interior == "cpu_pages"
    assert BlockLayout.for_backend("FLASH_ATTN", "LBNHC", 64).interior == "cells"


def test_an_attention_layer_the_worker_cannot_name_is_refused():
    """The worker finds a layer's query window by its ``layer_name``: a layer without it (or
    with another name) is refused at start-up, and an unknown name at run time, never skipped."""
    from types import SimpleNamespace

    from kvpolicy.vllm.settings import KVPolicyVLLMError
    from kvpolicy.vllm.worker import WorkerEviction, check_layer_names

    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    check_layer_names(names, {n: SimpleNamespace(layer_name=n) for n in names})  # vLLM 0.32's layers
    with pytest.raises(KVPolicyVLLMError, match="layer_name"):
        check_layer_names(names, {n: SimpleNamespace() for n in names})
    with pytest.raises(KVPolicyVLLMError, match="layer_name"):
        check_layer_names(names, {names[0]: SimpleNamespace(layer_name=names[0]),
                                  names[1]: SimpleNamespace(layer_name="attn")})
    worker = WorkerEviction.__new__(WorkerEviction)  # no runner: only the naming is exercised
    worker.layer_of = {n: i for i, n in enumerate(names)}
    assert worker._layer(SimpleNamespace(layer_name=names[1])) == 1
    with pytest.raises(KVPolicyVLLMError, match="not one of the KV cache's layers"):
        worker._layer(SimpleNamespace(layer_name="encoder.attn"))
    with pytest.raises(AttributeError, match="layer_name"):  # not skipped (start-up checks vLLM's layers have it)
        worker._layer(SimpleNamespace())


def test_a_steps_last_queries_are_each_requests_last_window_tokens_planned_once():
    """``StepRequests.last_queries``: per request its last ``min(scheduled, window)`` tokens, each
    at ring position ``token % window`` and at its row of the step's flattened tokens (None where
    those are the first rows in order); asked again (another KV-cache group of the step), the same plan."""
    import numpy as np
    import torch

    from kvpolicy.vllm.requests import StepRequests

    # three requests: a 6-token chunk after 3 tokens, one decode token after 10, a 2-token chunk after 0
    step = StepRequests(["a", "b", "c"], np.array([6, 1, 2]), np.array([3, 10, 0]), np.array([9, 4, 5]))
    take, pos, flat = step.last_queries(np.array([0, 1, 2]), 4, torch.device("cpu"))
    assert take.tolist() == [4, 1, 2]
    # a: tokens 5..8 at flattened rows 2..5; b: token 10 at row 6; c: tokens 0, 1 at rows 7, 8
    assert flat.tolist() == [2, 3, 4, 5, 6, 7, 8]
    assert pos.tolist() == [5 % 4, 6 % 4, 7 % 4, 8 % 4, 10 % 4, 0, 1]
    again = step.last_queries(np.array([0, 1, 2]), 4, torch.device("cpu"))
    assert all(x is y for x, y in zip(again, (take, pos, flat), strict=True))
    take, pos, flat = step.last_queries(np.array([1]), 4, torch.device("cpu"))  # another ring's requests
    assert take.tolist() == [1] and flat.tolist() == [6] and pos.tolist() == [2]
    decoding = StepRequests(["a", "b"], np.array([1, 1]), np.array([3, 10]), np.array([2, 4]))
    take, pos, flat = decoding.last_queries(np.array([0, 1]), 4, torch.device("cpu"))
    assert flat is None and pos.tolist() == [3, 10 % 4]  # the step's first rows, in order


def test_two_traces_of_one_process_write_files_of_their_own(tmp_path):
    """vLLM's in-process engine core runs engines one after another in one process: a second
    engine's trace must not write over the first's saved eviction inputs."""
    from kvpolicy.policy import eviction_input
    from kvpolicy.vllm.trace import EvictionTrace

    def inp(fill: float):
        keys = torch.full((1, 1, 4, 2), fill)
        return eviction_input(keys, keys, keys[:, :, :1], budget=2, recent=0, seed=0)

    first, second = EvictionTrace(tmp_path, rank=0), EvictionTrace(tmp_path, rank=0)
    for trace, fill in ((first, 1.0), (second, 2.0)):
        trace.record({"fill": fill})
        trace.save_input(inp(fill), kept=torch.tensor([[[0, 1]]]))
    saved = sorted(tmp_path.glob("evict-*.pt"))
    assert len(saved) == 2 and {float(torch.load(p)["keys"][0, 0, 0, 0]) for p in saved} == {1.0, 2.0}
    assert len(list(tmp_path.glob("worker-0-*.jsonl"))) == 2


@pytest.mark.parametrize("in_order", [True, False])
def test_query_capture_writes_each_query_where_the_ring_reads_it(in_order):
    """``QueryCapture``: token ``token_idx[i]`` of a layer's queries lands in ring row ``rows[i]``,
    that layer, position ``pos[i]``, and nothing else of the ring changes; element by element
    against the ring's own axes (a decode step's tokens in order take the path without a gather;
    rows past the step's tokens, such as padding, are ignored)."""
    from kvpolicy.vllm.requests import QueryCapture, RequestQueryRing

    gen = torch.Generator().manual_seed(0)
    ring = RequestQueryRing(window=4, layers=3, q_heads=2, head_dim=5, dtype=torch.float32, device=torch.device("cpu"))
    for q in ("a", "b", "c"):
        ring.row(q)
    before = torch.randn(ring.tensor.shape, generator=gen)
    ring.tensor.copy_(before)
    rows = torch.tensor([ring.row_of["c"], ring.row_of["a"], ring.row_of["a"]])
    pos = torch.tensor([3, 0, 1])
    token_idx = torch.arange(3) if in_order else torch.tensor([4, 0, 2])
    cap = QueryCapture.plan(ring, rows, pos, None if in_order else token_idx)  # as ``last_queries`` plans them
    step = torch.randn(3, 6, 2 * 5, generator=gen)  # [layers, T_step (one padding row past 5), Hq * D]
    for layer in range(3):
        cap.write(layer, step[layer])
    expected = before.clone()
    for layer in range(3):
        for i in range(3):
            expected[int(rows[i]), layer, int(pos[i])] = step[layer, int(token_idx[i])].view(2, 5)
    assert torch.equal(ring.tensor, expected)


def test_a_trace_saves_at_most_the_limit_set_when_it_starts(tmp_path, monkeypatch):
    """``KVPOLICY_VLLM_TRACE_SAVES`` is read when a trace starts (the benchmark sets 0 after
    importing kvpolicy): 0 saves none, while every eviction is still recorded."""
    from kvpolicy.policy import eviction_input
    from kvpolicy.vllm.trace import EvictionTrace

    keys = torch.zeros(1, 1, 4, 2)
    monkeypatch.setenv("KVPOLICY_VLLM_TRACE_SAVES", "0")
    none = EvictionTrace(tmp_path / "none", rank=0)
    monkeypatch.setenv("KVPOLICY_VLLM_TRACE_SAVES", "2")
    two = EvictionTrace(tmp_path / "two", rank=0)
    for trace in (none, two):
        for _ in range(3):
            trace.save_input(eviction_input(keys, keys, keys[:, :, :1], budget=2, recent=0, seed=0), kept=keys)
    assert not list((tmp_path / "none").glob("evict-*.pt"))
    assert len(list((tmp_path / "two").glob("evict-*.pt"))) == 2


@st.composite
def _lane_steps(draw):
    layers, kv_heads, block_size = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 8]))
    steps, end = [], 0
    for _ in range(draw(st.integers(1, 4))):
        start = draw(st.integers(0, 12))
        counts = torch.tensor(draw(st.lists(st.integers(0, start), min_size=layers * kv_heads,
                                            max_size=layers * kv_heads))).view(layers, kv_heads)
        tokens = draw(st.integers(1, 6))
        held = start + draw(st.integers(0, 6)) + tokens
        end += tokens
        steps.append(LaneStep(Lanes(counts, start), held, tokens, end))
    return steps, block_size


@settings(max_examples=150, deadline=None)
@given(_lane_steps())
def test_a_head_attention_plan_is_each_requests_lanes(case):
    """``plan_attention`` (every request at once) against each request's own ``Lanes``: its heads'
    lengths, its queries' rows, where its new tokens move (``Lanes.token_moves``), and, for the
    gathering path, the columns each query attends (its head's own slots, causal over the step's)."""
    steps, bs = case
    b, kv_heads = len(steps), steps[0].lanes.counts.shape[1]
    tables = torch.randperm(b * 8 * 2)[: b * 8].view(b, 8)
    plan = plan_attention(steps, tables, bs, torch.device("cpu"))
    gathered = plan.gathered
    assert plan.decodes == all(s.tokens == 1 for s in steps)
    m = 0
    for j, s in enumerate(steps):
        own = s.lanes.own(s.held)
        assert torch.equal(plan.lengths[:, j], own.to(torch.int32))
        assert plan.token_idx[j, : s.tokens].tolist() == list(range(s.end - s.tokens, s.end))
        assert plan.token_valid[j].tolist() == [i < s.tokens for i in range(plan.token_idx.shape[1])]
        src, dst = s.lanes.token_moves(s.held - s.tokens, s.tokens)
        for tok in range(s.tokens):
            for h in range(kv_heads):
                assert int(plan.moves.src_block[m]) == int(tables[j, int(src[tok]) // bs])
                assert int(plan.moves.src_offset[m]) == int(src[tok]) % bs and int(plan.moves.head[m]) == h
                for layer in range(own.shape[0]):
                    slot = int(dst[layer, h, tok])
                    assert int(plan.moves.dst_block[layer, m]) == int(tables[j, slot // bs])
                    assert int(plan.moves.dst_offset[layer, m]) == slot % bs
                m += 1
        for layer in range(own.shape[0]):
            for h in range(kv_heads):
                n = int(own[layer, h])
                for q in range(s.tokens):
                    want = [w < n and w <= n - s.tokens + q for w in range(gathered.mask.shape[-1])]
                    assert gathered.mask[layer, j, h, q].tolist() == want
                for w in range(min(n, gathered.blocks.shape[-1])):
                    assert int(gathered.blocks[layer, j, h, w]) == int(tables[j, w // bs])
                    assert int(gathered.offsets[layer, j, h, w]) == w % bs and int(gathered.heads[layer, j, h, w]) == h
    assert m == plan.moves.src_block.numel()


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_lane_columns_read_each_heads_own_slots_and_their_fields(data):
    """``LaneColumns`` (a group's requests at once) against each request's ``Lanes.columns``, read
    element by element: every valid column's keys and values are its head's lane slot in the
    request's blocks, its per-slot field is the one its ``field`` names, and each head has as
    many valid columns as slots it holds."""
    layers, kv_heads, bs, d = 2, 3, 4, 2
    start = data.draw(st.integers(1, 9))
    held = start + data.draw(st.integers(0, 6))
    lanes = []
    for _ in range(data.draw(st.integers(1, 3))):
        counts = torch.tensor(data.draw(st.lists(st.integers(0, start), min_size=layers * kv_heads,
                                                 max_size=layers * kv_heads))).view(layers, kv_heads)
        counts[0, 0] = start  # one width for the group, as evictions group requests by it
        lanes.append(Lanes(counts, start))
    r, per = len(lanes), -(-held // bs)
    nb = r * per + 2
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    kv = [(torch.randn(nb, bs, kv_heads, d, generator=gen), torch.randn(nb, bs, kv_heads, d, generator=gen))
          for _ in range(layers)]
    tables = torch.randperm(nb, generator=gen)[: r * per].view(r, per)
    per_slot = torch.randn(layers, r, kv_heads, held, generator=gen)
    cols = LaneColumns.of(lanes, held, torch.device("cpu"))
    read, taken = cols.read(kv, tables, bs), cols.take(per_slot)
    keys_only = cols.read(kv, tables, bs, values=False)
    assert torch.equal(keys_only[0], read[0]) and keys_only[1] is None
    width = cols.slot.shape[-1]
    for j, lane in enumerate(lanes):
        slot, field, valid = lane.columns(held, width)
        assert torch.equal(cols.valid[:, j], valid)
        assert torch.equal(valid.sum(-1), lane.own(held))
        for layer in range(layers):
            keys, values = kv[layer]
            for h in range(kv_heads):
                for w in range(width):
                    if not valid[layer, h, w]:
                        continue
                    s = int(slot[layer, h, w])
                    block, offset = int(tables[j, s // bs]), s % bs
                    assert torch.equal(read[0][layer, j, h, w], keys[block, offset, h])
                    assert torch.equal(read[1][layer, j, h, w], values[block, offset, h])
                    assert taken[layer, j, h, w] == per_slot[layer, j, h, int(field[layer, h, w])]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31 - 1), st.data())
def test_an_in_place_compaction_rewrites_only_what_moves_and_leaves_what_a_full_one_leaves(seed, data):
    """``in_place`` is, per layer and row, the length of the prefix every head keeps where it is;
    ``compact`` from there leaves the cache exactly as rewriting every kept slot does, and a row
    whose start is 0 (a row moving to other blocks) is rewritten whole."""
    g = torch.Generator().manual_seed(seed)
    lyr, r, h, bs, d, n = 2, 3, 2, 4, 3, 13
    k = data.draw(st.integers(1, n))
    nb = 24
    kept = torch.empty(lyr, r, h, k, dtype=torch.long)
    prefix = torch.empty(lyr, r, dtype=torch.long)
    for layer in range(lyr):
        for row in range(r):
            p = data.draw(st.integers(0, k))  # every head keeps slots 0 .. p-1 where they are
            for head in range(h):
                rest = (torch.randperm(n - p, generator=g)[: k - p] + p).sort().values
                kept[layer, row, head] = torch.cat([torch.arange(p), rest])
            prefix[layer, row] = k if bool((kept[layer, row] == torch.arange(k)).all()) else (
                (kept[layer, row] != torch.arange(k)).any(0).to(torch.uint8).argmax())
    assert torch.equal(in_place(kept), prefix)
    blocks = torch.randperm(nb, generator=g)
    tables, fresh = blocks[: r * 4].view(r, 4), blocks[r * 4 : r * 8].view(r, 4)
    caches = []
    # every slot or from the first that moves; values gathered, or read from the blocks (no stage
    # reads them: ``Stage.reads_values``); in place, or into fresh blocks (a first eviction under
    # prefix caching)
    for start, read_values, dst in [(None, True, tables), (in_place(kept), True, tables), (None, False, tables),
                                    (in_place(kept), False, tables), (None, True, fresh), (None, False, fresh)]:
        g2 = torch.Generator().manual_seed(seed)
        kv = [(torch.randn(nb, bs, h, d, generator=g2), torch.randn(nb, bs, h, d, generator=g2)) for _ in range(lyr)]
        gathered = [gather_paged(x, *slot_address(tables, n, bs)) for x in kv]
        compact(kv, dst, [(ks, vs if read_values else None) for ks, vs in gathered], kept, bs, start, sources=tables)
        caches.append((dst, kv))
    # Columns that are not the slots in order (per-head lanes: ``LaneColumns``): the keys gathered by
    # column, the kept ones named by column, the values read from the blocks through ``columns``.
    columns = torch.stack([torch.randperm(n, generator=g) for _ in range(lyr * r * h)]).view(lyr, r, h, n)
    kept_columns = columns.argsort(-1).gather(-1, kept)  # the column of each kept slot
    for read_values, dst in [(True, tables), (False, tables), (False, fresh)]:
        g2 = torch.Generator().manual_seed(seed)
        kv = [(torch.randn(nb, bs, h, d, generator=g2), torch.randn(nb, bs, h, d, generator=g2)) for _ in range(lyr)]
        by_column = []
        for layer, x in enumerate(kv):
            ks, vs = gather_paged(x, *slot_address(tables, n, bs))
            at = columns[layer][..., None].expand(-1, -1, -1, d)
            by_column.append((ks.gather(2, at), vs.gather(2, at) if read_values else None))
        compact(kv, dst, by_column, kept_columns, bs, sources=tables, columns=columns)
        caches.append((dst, kv))

    def kept_slots(dst, kv):  # each layer's and row's first k slots, keys then values
        return [c[dst[j]].flatten(0, 1)[:k] for pair in kv for c in pair for j in range(r)]

    want = kept_slots(*caches[0])
    for dst, kv in caches:
        assert all(torch.equal(a, b) for a, b in zip(kept_slots(dst, kv), want, strict=True))
    for _, kv in caches[1:4]:  # in place: the whole cache alike, whatever was rewritten
        assert all(torch.equal(a, b) for x, y in zip(kv, caches[0][1], strict=True) for a, b in zip(x, y, strict=True))


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 9), st.data())
def test_a_requests_heads_are_uneven_when_some_head_holds_fewer_than_its_room(layers, kv_heads, room, data):
    """``RequestRecord.uneven``, read at every step from the fewest count noted at the eviction,
    is the test over every head's count: some head holds fewer slots than the request's room."""
    from kvpolicy.vllm.requests import KeptSlots, RequestPolicy, RequestRecord
    from kvpolicy.vllm.settings import Resolved

    record = RequestRecord(RequestPolicy(Resolved(None, "none", 0), None))
    assert not record.uneven  # before any eviction every head holds every slot
    counts = torch.tensor(data.draw(st.lists(st.integers(0, room), min_size=layers * kv_heads,
                                             max_size=layers * kv_heads))).view(layers, kv_heads)
    record.counted_heads(counts)
    assert not record.uneven  # no kept slots recorded yet
    record.kept = KeptSlots(torch.zeros(layers, kv_heads, room, dtype=torch.long))
    assert record.uneven == bool((counts < room).any())
