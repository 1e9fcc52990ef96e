"""Per-row pages (kvevict.storage.paged): rows of a shared batch hold only their own pages of one pool,
read in place by the fused kernels; every answer equals the rectangle storage's, pages come and go
with the rows, and admission counts exactly what the cache holds."""

import gc

import pytest
import torch

import kvevict
from conftest import decode_joining, tiny_model
from kvevict.attention import ATTN_NAME, register
from kvevict.kernels import BACKENDS, Run, decode_attention, decode_attention_reference
from kvevict.serve.batch import DecodeBatch
from kvevict.storage import PAGE, Pools, page_slots
from kvevict.storage.codes import quantize


def _model(arch="llama-gqa"):
    model = tiny_model(arch)
    register()
    model.set_attn_implementation(ATTN_NAME)
    return model


def _serve(model, policy, budget, kv_bits, pool, new=20, joins=(4, 7, 9)):
    """Rows joining a running batch mid-decode and leaving when done (as the server does); every
    row's greedy tokens, and the pool's pages in use after each step and at the end."""
    torch.manual_seed(5)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (30, 9, 21, 45)]
    in_use = []
    outs = decode_joining(
        lambda p: DecodeBatch.prefill(model, p, policy, budget, None, kv_bits, pool),
        prompts,
        joins,
        new,
        60,
        None if pool is None else lambda: in_use.append(pool.pages_in_use()),
    )
    if pool is not None:
        in_use.append(pool.pages_in_use())
    return outs, in_use


@pytest.mark.parametrize("kernel", ["torch", "cpu", "triton"])
@pytest.mark.parametrize(
    "policy, budget, kv_bits", [("h2o", 8, None), ("h2o", 64, None), ("h2o", 40, 8), ("tova", 12, 4), ("adakv", 16, 8)]
)
def test_paged_rows_equal_the_rectangle_and_give_every_page_back(monkeypatch, kernel, policy, budget, kv_bits):
    if kernel == "cpu" and not BACKENDS["cpu"].available()[0]:
        pytest.skip("no compiler here: the cpu kernel cannot be built")
    if kernel == "triton":
        from kvevict.kernels.triton_decode import interpreting

        if not interpreting():
            pytest.skip("the Triton kernel runs here only in triton's CPU interpreter")
        if policy != "h2o" or budget not in (8, 40):
            pytest.skip("interpreted Triton is slow: one packed and one dense case cover its page tables")
    monkeypatch.setenv("KVEVICT_KERNEL", kernel)
    model = _model("llama-mha" if kernel == "triton" else "llama-gqa")  # Triton's tiles need head_dim >= 16
    short = dict(new=5, joins=(1, 2, 3)) if kernel == "triton" else {}  # interpreted: a few steps
    want, _ = _serve(model, policy, budget, kv_bits, None, **short)
    pool = Pools()
    got, in_use = _serve(model, policy, budget, kv_bits, pool, **short)
    assert got == want
    assert max(in_use) > 0 and in_use[-1] == 0  # the last row left: every page is free again
    gc.collect()
    assert pool.pages_in_use() == 0


def test_a_short_row_beside_a_long_one_holds_its_own_pages():
    model = _model()
    pool = Pools()
    with torch.no_grad():
        long, _ = DecodeBatch.prefill(model, [i % 120 + 1 for i in range(200)], "h2o", 256, None, 8, pool)
        short, _ = DecodeBatch.prefill(model, list(range(1, 10)), "h2o", 256, None, 8, pool)
        rect_long, _ = DecodeBatch.prefill(model, [i % 120 + 1 for i in range(200)], "h2o", 256, None, 8)
        rect_short, _ = DecodeBatch.prefill(model, list(range(1, 10)), "h2o", 256, None, 8)
        long.join(short)
        rect_long.join(rect_short)
    layers = len(long.cache.layers)
    for layer in long.cache.layers:
        t = layer.tiers[0]
        # keys and values, and each bookkeeping tensor (position, H2O's statistic): pages of their own
        holders = [t.store, *t.bookkeeping.values()]
        assert len(holders) == 3
        assert all(x.own == [page_slots(200, 256) // PAGE, 1] for x in holders)  # 7 pages and 1, not 7 and 7
        assert t.nbytes() == sum(8 * x.pool.page_bytes() + x.table.nbytes for x in holders)
        kv_page = t.store.pool.page_bytes()
    assert pool.pages_in_use() == 8 * 3 * layers
    # the rectangle gives the short row the long one's width: its K/V alone are 7 pages a layer
    rect_kv = sum(layer.tiers[0].store.nbytes() for layer in rect_long.cache.layers)
    assert rect_kv == 14 * kv_page * layers
    with torch.no_grad():
        long.keep([1])  # the long row leaves: its pages go back at once
    assert pool.pages_in_use() == 3 * layers
    del long, t, holders, layer
    gc.collect()  # a cache dropped whole gives its pages back too
    assert pool.pages_in_use() == 0


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_rows_of_different_policies_bring_and_take_their_statistics_pages(kv_bits):
    """Rows of policies with different statistics join (the tier takes a statistic's pages for
    every row) and leave (a statistic no row reads any more gives its pages back): the tokens equal
    the rectangle's, and every page is free at the end."""
    model = _model()
    policies = ["recency", "h2o", "tova", "h2o"]

    def run(pool):
        torch.manual_seed(5)
        prompts = [torch.randint(1, 128, (n,)).tolist() for n in (30, 9, 21, 45)]
        it = iter(policies)
        in_use = []
        outs = decode_joining(
            lambda p: DecodeBatch.prefill(model, p, next(it), 16, None, kv_bits, pool),
            prompts,
            (2, 5, 8),
            12,
            40,
            None if pool is None else lambda: in_use.append(pool.pages_in_use()),
        )
        return outs, in_use + ([pool.pages_in_use()] if pool is not None else [])

    want, _ = run(None)
    pool = Pools()
    got, in_use = run(pool)
    assert got == want
    assert max(in_use) > 0 and in_use[-1] == 0
    gc.collect()
    assert pool.pages_in_use() == 0


def test_positions_past_int16_move_a_paged_tier_to_int32_pages():
    """A sequence past 32,767 positions: the paged positions move to int32 pages (the int16 ones
    go back), read as the rectangle's, and decoding goes on as with the rectangle."""
    model = _model()
    pool = Pools()
    ids = torch.randint(1, 128, (2, 40))
    caches = [kvevict.make_cache(model, "h2o", 16, pages=p) for p in (None, pool)]
    with torch.no_grad():
        for c in caches:
            model(ids, cache=c, use_cache=True)
    before = pool.pages_in_use()
    for c in caches:
        for layer in c.layers:
            for t in layer.tiers:
                t.widen_positions(40_000)
    assert pool.pages_in_use() == before  # the same pages, now int32: the int16 ones were given back
    for rect, paged in zip(caches[0].layers, caches[1].layers):
        assert paged.tiers[0].pos_dtype == torch.int32
        assert torch.equal(paged.tiers[0].pos, rect.tiers[0].pos)
    with torch.no_grad():
        nxt = torch.randint(1, 128, (2, 1))
        for _ in range(5):
            a, b = (model(nxt, cache=c, use_cache=True).logits for c in caches)
            assert torch.allclose(a, b, atol=1e-5)
            nxt = a[:, -1:].argmax(-1)


def test_repeated_rows_get_their_own_copies_of_the_pages():
    model = _model()
    pool = Pools()
    with torch.no_grad():
        batch, logits = DecodeBatch.prefill(model, list(range(1, 40)), "h2o", 16, None, None, pool)
        batch.cache.batch_repeat_interleave(2)
        batch.mask, batch.next_pos = batch.mask.repeat(2, 1), batch.next_pos.repeat(2)
        out = batch.step([3, 5])
        alone, _ = DecodeBatch.prefill(model, list(range(1, 40)), "h2o", 16, None)
        assert torch.allclose(out[0], alone.step([3])[0], atol=1e-5)
    store = batch.cache.layers[0].tiers[0].store
    ids = store.table[store.table > 0].tolist()
    assert len(ids) == len(set(ids)) == 2  # a page each, none written by two rows


@pytest.mark.parametrize(
    "bits, group", [(8, 32), (4, 32), (2, 32), (None, 0), (4, 16)]
)  # 4 groups a token: Triton loads zeros and steps as words
def test_a_paged_run_reads_as_its_rectangle(bits, group):
    """The kernels' page-table addressing against the same slots laid out in a rectangle: the
    reference, the compiled cpu kernel and the Triton kernel (interpreted), padding masked, rows of
    different page counts."""
    torch.manual_seed(0)
    b, h, g, d, n = 3, 2, 3, 64, 70
    cols = -(-n // PAGE)
    k, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    parts = [*quantize(k, bits, group), *quantize(v, bits, group)] if bits else [k, v]
    table = torch.randperm(b * cols).view(b, cols) + 1  # every row's pages somewhere in the pool
    table[1, 1:] = 0  # row 1 holds one page: its later slots read page 0 and are masked
    pools = []
    for t in parts:
        pool = t.new_zeros(b * cols + 1, h, PAGE, t.shape[-1])
        padded = torch.cat([t, t.new_zeros(b, h, cols * PAGE - n, t.shape[-1])], dim=2)
        pool[table] = padded.view(b, h, cols, PAGE, -1).permute(0, 2, 1, 3, 4)
        pools.append(pool)
    mask = torch.ones(b, 1, n, dtype=torch.bool)
    mask[1, :, PAGE:] = False
    split = (tuple(pools[:3]), tuple(pools[3:])) if bits else ((pools[0],), (pools[1],))
    paged = Run(bits or 32, group, *split, n, table=table, page=PAGE)
    flat = (tuple(parts[:3]), tuple(parts[3:])) if bits else ((parts[0],), (parts[1],))
    rect = Run(bits or 32, group, *flat, n)
    q, k_new, v_new = torch.randn(b, h * g, 1, d), torch.randn(b, h, 1, d), torch.randn(b, h, 1, d)
    want = decode_attention_reference(q, [rect], k_new, v_new, mask, 0.125)
    backends = ["torch"] + (["cpu"] if BACKENDS["cpu"].available()[0] else [])
    from kvevict.kernels.triton_decode import interpreting

    if interpreting():  # the Triton kernel's table addressing, in triton's CPU interpreter
        backends.append("triton")
    for name in backends:
        out, pg = decode_attention(q, [paged], k_new, v_new, mask, 0.125, backend=name)
        assert torch.allclose(out, want[0], atol=2e-5), name
        assert torch.allclose(pg, want[1], atol=2e-6), name


def test_pages_must_be_a_pool_set():
    import kvevict

    with pytest.raises(ValueError, match="kvevict.storage.Pools"):
        kvevict.make_cache(_model(), "h2o", 8, pages="yes")


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_admission_counts_a_paged_batch_exactly(kv_bits):
    """What the server's admission counts for a batch of paged rows (each its own pages, the
    bookkeeping and the page table at the batch's width) is what the cache then holds."""
    from kvevict.serve.budgeter import Budgeter

    model = _model()
    budgeter = Budgeter(model, kv_bits)
    pool = Pools()
    # the last row is the longest and has the widest budget: the batch is as wide as admission says
    rows = [("recency", 8, None), ("tova", 20, None), ("pyramidkv", 32, None), ("h2o", 70, 4)]
    batch, specs = None, []
    with torch.no_grad():
        for i, (policy, budget, recent) in enumerate(rows):
            n = 11 + 17 * i
            other, _ = DecodeBatch.prefill(
                model, [t % 120 + 1 for t in range(n)], policy, budget, recent, kv_bits, pool
            )
            assert other.kv_bytes() == budgeter.batch_bytes([(policy, budget, recent, n)], paged=True)
            specs.append((policy, budget, recent, n))
            if batch is None:
                batch = other
            else:
                batch.join(other)
            assert batch.kv_bytes() == budgeter.batch_bytes(specs, paged=True)
        for _ in range(3):
            batch.step([1, 2, 3, 4])
            specs = [(p, b, r, n + 1) for p, b, r, n in specs]
            assert batch.kv_bytes() == budgeter.batch_bytes(specs, paged=True)
        # less than the rectangle, where every row is as wide as the widest
        assert batch.kv_bytes() < budgeter.batch_bytes(specs)
        batch.keep([0, 3])
        assert batch.kv_bytes() == budgeter.batch_bytes([specs[0], specs[3]], paged=True)
        ada, _ = DecodeBatch.prefill(model, list(range(1, 20)), "adakv", 8, None, kv_bits, pool)
        other, _ = DecodeBatch.prefill(model, list(range(1, 45)), "ada-snapkv", 40, None, kv_bits, pool)
        ada.join(other)
        assert ada.kv_bytes() == budgeter.batch_bytes(
            [("adakv", 8, None, 19), ("ada-snapkv", 40, None, 44)], paged=True
        )


def test_the_row_pages_benchmark_lays_rows_out_three_ways():
    """benchmarks/row_pages.py: per-row pages hold fewer K/V pages than the rectangle and the old width
    buckets, which split rows of 1, 2 and 6 pages into two batches (one forward each)."""
    from benchmarks import row_pages

    model = _model()
    prompts = [[t % 120 + 1 for t in range(n)] for n in (20, 50, 190)]
    made = {name: row_pages.build(model, prompts, 400, 8, name) for name in ("pages", "rectangle", "buckets")}
    assert [len(made[n]) for n in ("pages", "rectangle", "buckets")] == [1, 1, 2]
    kv = {
        n: sum(
            t.store.nbytes() - getattr(t.store, "table", torch.empty(0)).nbytes
            for b in made[n]
            for layer in b.cache.layers
            for t in layer.tiers
        )
        for n in made
    }
    page = kv["rectangle"] // (3 * 6 * len(model.model.layers))  # the rectangle: 3 rows of 6 pages
    assert (kv["pages"], kv["buckets"]) == (9 * page * len(model.model.layers), 10 * page * len(model.model.layers))
    assert row_pages.steps(made["pages"], 2) > 0


@pytest.mark.parametrize("policy, budget, kv_bits", [("h2o", 40, 4), ("tova", 12, None), ("adakv", 16, 8)])
def test_compacting_between_steps_moves_pages_under_their_rows_and_frees_the_rest(policy, budget, kv_bits):
    """``Pools.compact`` after every step (rows joining and leaving leave free pages amid used
    ones): every row decodes the rectangle's tokens, and each pool keeps only page 0 and the pages
    in use, smaller than before whenever pages were free."""
    model = _model()
    want, _ = _serve(model, policy, budget, kv_bits, None)
    pool = Pools()
    shrank, kept = [], []

    def squeeze():
        before = pool.nbytes()
        pool.compact()
        shrank.append(pool.nbytes() < before)
        kept.append(all(p.pages == p.in_use() + 1 and not p.free for p in pool.pools.values()))

    torch.manual_seed(5)
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (30, 9, 21, 45)]
    got = decode_joining(
        lambda p: DecodeBatch.prefill(model, p, policy, budget, None, kv_bits, pool),
        prompts,
        (4, 7, 9),
        20,
        60,
        squeeze,
    )
    assert got == want
    assert all(kept) and any(shrank)


def test_slack_never_takes_what_the_admitted_rows_may_still_need():
    """With ``reserved`` (what admitted rows may hold) set, a pool's growth slack comes only out of
    limit - reserved - idle pages, so reserved + idle <= limit keeps holding while rows take pages
    (from their reservation) in several pools beside another pool's free pages, and the pools'
    total never passes the limit."""
    torch.manual_seed(0)
    page = 32  # bytes of a page of each pool below
    pools = Pools(page=4, limit=200 * page)
    a, b, c = (pools.get([(1, 8, torch.uint8)], "cpu", empty) for empty in range(3))
    a.release(a.alloc(5))  # rows that left: 5 free pages of a
    pools.reserved = 190 * page
    assert pools.reserved + pools.idle_bytes() <= pools.limit  # what admission checks
    owned = {b: [], c: []}
    grew = 0
    for step in range(400):  # rows of b and c grow within the reservation; a row leaving takes its share along
        pool = b if torch.rand(()) < 0.5 else c
        if torch.rand(()) < 0.1 and owned[pool]:
            pool.release([owned[pool].pop()])
            pools.reserved -= page
        elif (len(owned[b]) + len(owned[c])) * page < pools.reserved:
            size = pool.pages
            owned[pool] += pool.alloc(1)
            grew += pool.pages > size + 1  # a growth with slack
        assert pools.nbytes() <= pools.limit
        assert pools.reserved + pools.idle_bytes() <= pools.limit
    assert grew and (len(owned[b]) + len(owned[c])) * page == pools.reserved
