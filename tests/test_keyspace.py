"""Keys stored centred and rotated (kvevict.keyspace): exact in full precision, and what keeps a
model with outlier key channels (Qwen2's k_proj biases) usable at 4 bits."""

import pytest
import torch
from transformers import DynamicCache

import kvevict
from conftest import tiny_model
from kvevict.keyspace import KeySpace, hadamard, rotate
from kvevict.storage import Storage
from test_quantized import _stream


def outlier_model(seed=0, bias=300.0):
    """A tiny Qwen2 (k_proj with biases) whose keys have outlier channels where Qwen2.5-1.5B's are:
    biases of a few hundred (its layer 0: 354, 320, 318, 288 where the median is 0.5) on the
    channels of the slowest RoPE pairs (63 and 127 of 128 there), nearly constant after RoPE."""
    model = tiny_model("qwen2", seed=seed)
    d = model.config.hidden_size // model.config.num_attention_heads  # 16: RoPE pairs (i, i + 8)
    for layer in model.model.layers:
        with torch.no_grad():
            b = layer.self_attn.k_proj.bias.view(-1, d)
            b[:, d // 2 - 1] += bias
            b[:, d - 1] -= 0.9 * bias
            b[:, d // 2 - 2] += 0.8 * bias
    return model


@pytest.mark.parametrize("d", [16, 64, 96, 128, 256])
def test_the_rotation_is_orthonormal_and_symmetric(d):
    h = hadamard(d, torch.float64, "cpu")
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert (h.abs() > 0).sum() == d * (d & -d)  # dense over its power-of-two blocks
    x = torch.randn(3, 5, d, dtype=torch.float64)
    assert torch.allclose(rotate(x), x @ h, atol=1e-6)  # the fast transform is the matrix (in float32)
    # element by element: a row's result does not depend on the rows around it
    assert torch.equal(rotate(x.float())[1:2], rotate(x.float()[1:2]))


def test_scores_are_the_same_up_to_a_constant_per_query():
    torch.manual_seed(0)
    k, q = torch.randn(2, 3, 40, 64, dtype=torch.float64) * 5 + 100, torch.randn(2, 3, 5, 64, dtype=torch.float64)
    space = KeySpace()
    stored = space.enter(k)
    shift = q @ k.transpose(-1, -2) - KeySpace.query(q) @ stored.transpose(-1, -2)
    assert torch.allclose(shift, shift[..., :1].expand_as(shift), atol=1e-9)  # softmax cancels it
    assert torch.allclose(space.leave(stored), k, atol=1e-9)
    # the centre is the row's mean key (in float16): stored keys hold what varies across tokens
    assert stored.mean(2).abs().max() < 0.5 and (k @ hadamard(64, k.dtype, "cpu")).mean(2).abs().max() > 500


def test_the_centre_counts_real_tokens_only():
    k = torch.randn(2, 1, 6, 16)
    valid = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    space = KeySpace()
    space.enter(k, valid)
    want = torch.stack([k[0, 0].mean(0), k[1, 0, 2:].mean(0)]).unsqueeze(1).half()
    assert torch.equal(space.center, want)


@pytest.mark.parametrize("arch", ["llama-gqa", "qwen2"])
def test_rotated_keys_in_full_precision_equal_the_full_cache(arch):
    model = tiny_model(arch)
    torch.manual_seed(1)
    prompt, steps = torch.randint(0, 128, (2, 40)), torch.randint(0, 128, (2, 10))
    ref = _stream(model, DynamicCache(), prompt, steps)
    cache = kvevict.make_cache(model, "h2o", budget=64, keys="rotated")
    assert cache.layers[0].storage.rotates_keys
    got = _stream(model, cache, prompt, steps)
    d = model.config.hidden_size // model.config.num_attention_heads
    assert cache.layers[0].keyspace is not None and cache.layers[0].keyspace.center.shape == (2, 2, d)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


def test_packed_tiers_rotate_by_default_and_float_ones_do_not():
    assert Storage(kv_bits=4).rotates_keys and Storage(kv_bits=8, evicted_bits=4).rotates_keys
    assert Storage(kv_bits=2).rotates_keys and Storage(kv_bits=8).rotates_keys
    assert Storage(evicted_bits=4).rotates_keys  # the model's dtype, evicted tokens demoted to int4
    assert not Storage().rotates_keys and not Storage(kv_bits=16).rotates_keys
    assert not Storage(kv_bits=4, keys="raw").rotates_keys and Storage(kv_bits=16, keys="rotated").rotates_keys
    with pytest.raises(ValueError, match="keys must be one of"):
        Storage(keys="hadamard")


def _error(model, cache, prompt, steps, ref):
    return (_stream(model, cache, prompt, steps) - ref).abs().max().item()


def test_outlier_key_channels_survive_int4_when_rotated():
    model = outlier_model()
    torch.manual_seed(2)
    prompt, steps = torch.randint(0, 128, (2, 60)), torch.randint(0, 128, (2, 12))
    ref = _stream(model, DynamicCache(), prompt, steps)
    scale = ref.abs().max().item()
    raw = _error(model, kvevict.make_cache(model, "h2o", budget=128, kv_bits=4, keys="raw"), prompt, steps, ref)
    rot = _error(model, kvevict.make_cache(model, "h2o", budget=128, kv_bits=4), prompt, steps, ref)
    int8 = _error(model, kvevict.make_cache(model, "h2o", budget=128, kv_bits=8), prompt, steps, ref)
    # raw int4 groups spend their levels on the outliers; rotated, int4 comes near int8
    assert rot < raw / 4, (rot, raw)
    assert rot < 0.05 * scale, (rot, scale)
    assert int8 < 0.05 * scale


@pytest.mark.parametrize("kw", [dict(kv_bits=4, evicted_bits=2), dict(kv_bits=8, evicted_bits=4)])
def test_rotated_tiers_on_a_padded_batch_equal_each_row_alone(kw):
    """Each row keeps its own centre (its real tokens'): a padded batch decodes as each row alone,
    through eviction and demotion between tiers."""
    model = outlier_model(bias=50.0)
    torch.manual_seed(3)
    a, b = torch.randint(1, 128, (1, 50)), torch.randint(1, 128, (1, 35))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 15, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :15] = 0

    def run(x, m):
        cache = kvevict.make_cache(model, "h2o", budget=16, evicted_budget=12, **kw)
        out = model.generate(
            x,
            attention_mask=m,
            cache=cache,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        assert cache.layers[0].keyspace.center.shape[0] == x.shape[0]
        return out.sequences[:, -8:], torch.stack(out.logits, 1)

    seqs, logits = run(ids, mask)
    for row, x in ((0, a), (1, b)):
        s_alone, l_alone = run(x, torch.ones_like(x))
        assert torch.equal(seqs[row], s_alone[0])
        assert torch.allclose(logits[row], l_alone[0], atol=1e-4), (logits[row] - l_alone[0]).abs().max()


def test_compact_positions_re_rotate_rotated_keys():
    model = tiny_model("llama-gqa")
    torch.manual_seed(4)
    prompt, steps = torch.randint(0, 128, (1, 40)), torch.randint(0, 128, (1, 8))
    plain = _stream(model, kvevict.make_cache(model, "h2o", budget=20, compact=True, keys="raw"), prompt, steps)
    rot = _stream(model, kvevict.make_cache(model, "h2o", budget=20, compact=True, keys="rotated"), prompt, steps)
    assert torch.allclose(plain, rot, atol=1e-4), (plain - rot).abs().max()


def test_knorm_ranks_the_keys_the_model_made():
    model = outlier_model()
    torch.manual_seed(5)
    prompt, steps = torch.randint(0, 128, (1, 50)), torch.randint(0, 128, (1, 6))
    kept = []
    for keys in ("raw", "rotated"):
        cache = kvevict.make_cache(model, "knorm", budget=24, keys=keys)
        _stream(model, cache, prompt, steps)
        kept.append(torch.sort(cache.layers[1].pos, -1).values)
    assert torch.equal(kept[0], kept[1])
