"""A slot's position is int16 while every row's own positions fit, int32 once one passes
32,767, and int16 again once it leaves. Padding and a batch history that outlived its rows (the
batch's ``seen``) never widen; the server's admission counts the int32 positions of a batch with a
row that may pass, so what it counts is exactly what the cache holds."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvevict
from kvevict.attention import ATTN_NAME, register
from kvevict.serve.batch import DecodeBatch
from kvevict.storage import Pools
from kvevict.tier import POS16_MAX

LONG = POS16_MAX - 7  # a prompt whose last position, 32,759, fits int16; 9 more tokens pass it


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """32K tokens are thousands of small ops: one thread runs them in seconds, two on a busy CPU
    (conftest's) in half a minute."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    """Two layers, 32 channels: 32K tokens of prefill in a second or two (and positions that far)."""
    torch.manual_seed(0)
    m = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1 << 16,
        )
    ).eval()
    register()
    m.set_attn_implementation(ATTN_NAME)
    return m


@pytest.fixture(scope="module")
def budgeter(model):
    from kvevict.serve.budgeter import Budgeter

    return Budgeter(model)


def _long_row(model, pool, n=LONG, budget=32):
    """One row of ``n`` tokens fed in chunks (as a long prompt's block prefill), as a DecodeBatch."""
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (1, n))
    cache = kvevict.make_cache(model, "h2o", budget, pages=pool)
    with torch.no_grad():
        for s in range(0, n, 2048):
            model(ids[:, s : s + 2048], cache=cache, use_cache=True, logits_to_keep=1)
    return DecodeBatch(model, cache, torch.ones(1, n, dtype=torch.long), torch.tensor([n]))


def _widths(batch) -> set:
    return {t.pos_dtype for layer in batch.cache.layers for t in layer.tiers}


def test_padding_and_a_history_that_outlived_its_rows_keep_int16_positions(model, budgeter):
    """A short row joins a long one (its mask left-padded to the long one's history), the long one
    leaves, and the short one decodes on until the batch has seen more than 32,767 columns: its own
    positions stay under 100, so they stay int16, and the cache holds what admission counts for it."""
    pool = Pools()
    with torch.no_grad():
        batch = _long_row(model, pool, LONG - 20)
        short, _ = DecodeBatch.prefill(model, list(range(1, 10)), "h2o", 32, None, None, pool)
        batch.join(short)
        batch.keep([1])  # the long row leaves; the short one's padding stays in the batch's history
        for step in range(40):
            batch.step([5])
    assert batch.cache.layers[0].seen > POS16_MAX + 1  # what used to widen the positions
    assert _widths(batch) == {torch.int16}
    assert batch.kv_bytes() == budgeter.batch_bytes([("h2o", 32, None, 9 + 40)], paged=True)


def test_a_row_past_int16_widens_its_batch_and_admission_counts_it_exactly(model, budgeter):
    """A long row decoding beside a short one passes 32,767 positions: every row's positions turn
    int32 (one tensor for the batch), and the admission bound stays exactly what the cache holds,
    step by step; when the long row leaves, the short one's go back to int16 and to its own bound."""
    pool = Pools()
    with torch.no_grad():
        batch = _long_row(model, pool)
        short, _ = DecodeBatch.prefill(model, list(range(1, 10)), "h2o", 32, None, None, pool)
        batch.join(short)
        lengths = [LONG, 9]
        assert batch.kv_bytes() == budgeter.batch_bytes([("h2o", 32, None, n) for n in lengths], paged=True)
        for step in range(12):
            batch.step([3, 5])
            lengths = [n + 1 for n in lengths]
            passed = lengths[0] - 1 > POS16_MAX  # the long row's last position
            assert _widths(batch) == {torch.int32 if passed else torch.int16}, step
            assert batch.kv_bytes() == budgeter.batch_bytes([("h2o", 32, None, n) for n in lengths], paged=True)
        assert passed
        # a row alone past int16: 2 bytes more per slot and KV head in every layer than a short row
        wide, narrow = (budgeter.row_bytes("h2o", 32, None, n) for n in (lengths[0], 9 + 12))
        assert wide - narrow == 32 * 2 * budgeter.heads * len(model.model.layers)
        # the int32 positions pool admission opens for such a row: its page 0 is what the pool holds
        int32 = [p for p in pool.pools.values() if p.tensors[0].dtype == torch.int32]
        assert len(int32) == 1
        assert budgeter.opening("h2o", None, lengths[0])[("int32 positions", budgeter.heads)] == int32[0].page_bytes()
        assert budgeter.opening_bytes("h2o", None, lengths[0]) == (
            budgeter.opening_bytes("h2o", None, 9) + int32[0].page_bytes()
        )
        batch.keep([1])  # the long row leaves: the short one holds int16 positions again
        assert _widths(batch) == {torch.int16}
        assert batch.kv_bytes() == budgeter.batch_bytes([("h2o", 32, None, lengths[1])], paged=True)
        batch.step([7])
        assert _widths(batch) == {torch.int16}


def test_a_rectangle_row_past_int16_is_what_row_bytes_counts(model, budgeter):
    """Without pages (one rectangle per layer) a row alone past 32,767 positions holds exactly
    ``row_bytes`` (int32 positions included)."""
    with torch.no_grad():
        batch = _long_row(model, None, POS16_MAX + 3)
        assert _widths(batch) == {torch.int32}
        assert batch.kv_bytes() == budgeter.row_bytes("h2o", 32, None, POS16_MAX + 3)
        assert batch.kv_bytes() == budgeter.batch_bytes([("h2o", 32, None, POS16_MAX + 3)])
