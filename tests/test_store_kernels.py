"""The store path's fused CPU kernels (kvevict.kernels.store): the rotation of keys and queries and
the quantization of new tokens, each one call, held bit for bit to the torch reference."""

import pytest
import torch

from kvevict.kernels import cpu
from kvevict.kernels.store import quantize_into, quantize_pair, rotate, rotate_reference
from kvevict.storage.codes import dequantize, quantize

built, why = cpu.available()
pytestmark = pytest.mark.skipif(not built, reason=f"the compiled CPU module does not build here: {why}")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _keys(shape, dtype, seed=0):
    """Keys of very different scales per token, an all-zero token, a token of tiny values and one
    all negative: every branch of the groups' grid (zero range, bottom at the minimum or below the
    maximum, the step byte's clamp)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 60
    flat = x.view(-1, shape[-1])
    flat[0] = 0
    flat[1] = 1e-7
    flat[2] = -flat[2].abs() - 3
    flat[3, :: max(1, shape[-1] // 4)] = 300.0  # an outlier channel per group
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [16, 64, 96, 128])
def test_the_fused_rotation_is_the_reference_bit_for_bit(dtype, d):
    x = _keys((3, 2, 5, d), dtype)
    got = rotate(x)
    assert got.dtype == dtype and torch.equal(got, rotate_reference(x))
    c = (torch.randn(3, 2, d) * 20).half()
    assert torch.equal(rotate(x, c), rotate_reference(x - c.unsqueeze(2).to(dtype)))
    # row by row: a row's result does not depend on the rows around it
    assert torch.equal(rotate(x)[1:2], rotate(x[1:2].contiguous()))


def test_a_strided_input_is_rotated_as_a_copy_of_it():
    x = _keys((2, 6, 3, 64), torch.float32)
    view = x.transpose(1, 2)  # not contiguous: the kernel reads a copy
    assert torch.equal(rotate(view), rotate_reference(view.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (4, 16), (2, 8), (8, 64)])
def test_the_fused_quantization_is_the_reference_bit_for_bit(dtype, bits, group):
    k, v = _keys((2, 3, 7, 64), dtype, seed=1), _keys((2, 3, 7, 64), dtype, seed=2)
    got = quantize_pair(k, v, bits, group)
    want = [*quantize(k, bits, group), *quantize(v, bits, group)]
    assert len(got) == 6
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == torch.uint8 and torch.equal(a, b)
    # and it decodes within half a step, as the reference's codes do
    back = dequantize(*got[:3], bits, group, torch.float32)
    assert back.shape == k.shape


def test_the_torch_backend_runs_the_reference(monkeypatch):
    """``KVEVICT_KERNEL=torch`` (the reference everywhere): the same bits, through torch's operators."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    x = _keys((2, 2, 1, 128), torch.bfloat16)
    with Ops():
        fused = rotate(x)
    n_fused, Ops.n = Ops.n, 0
    monkeypatch.setenv("KVEVICT_KERNEL", "torch")
    with Ops():
        ref = rotate(x)
    assert torch.equal(fused, ref)
    # the call, its output and views, against log2(128) = 7 butterfly stages and their buffers
    assert n_fused <= 3 and Ops.n >= 9


def test_the_fused_kernels_trace_as_one_op_each():
    x = _keys((2, 2, 1, 64), torch.bfloat16)
    c = (torch.randn(2, 2, 64) * 5).half()

    def step(x, c):
        k = rotate(x, c)
        return k, *quantize_pair(k, x, 4, 32)

    eager = step(x, c)
    compiled = torch.compile(step, fullgraph=True, backend="eager")(x, c)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("with_take", [False, True])
def test_quantizing_into_the_slots_writes_what_the_torch_path_writes(monkeypatch, dtype, bits, with_take):
    """A packed store's write: one fused call, the same bytes in every slot as quantize_pair and six
    scatters (a slot ``take`` leaves out keeps what it held)."""
    from kvevict.storage.rect import PackedStore

    g = torch.Generator().manual_seed(4)
    b, h, n, j, d = 2, 3, 11, 4, 64
    idx = torch.stack([torch.randperm(n, generator=g)[:j] for _ in range(b * h)]).view(b, h, j)
    k, v = _keys((b, h, j, d), dtype, seed=5), _keys((b, h, j, d), dtype, seed=6)
    take = torch.rand(b, h, j, generator=g) > 0.3 if with_take else None
    stores = []
    for kernel in ("auto", "torch"):
        monkeypatch.setenv("KVEVICT_KERNEL", kernel)
        store = PackedStore(b, h, n, d, d, dtype, "cpu", bits, 32)
        store.write(
            torch.arange(n).expand(b, h, n), _keys((b, h, n, d), dtype, seed=7), _keys((b, h, n, d), dtype, seed=8)
        )
        store.write(idx, k, v, take)
        stores.append([*store.k.tensors(), *store.v.tensors()])
    for fused, ref in zip(*stores):
        assert torch.equal(fused, ref)
    monkeypatch.setenv("KVEVICT_KERNEL", "auto")  # and the fused call is what ran above
    copies = [t.clone() for t in stores[1]]
    assert quantize_into(copies, idx, k, v, bits, 32, take) is None
    for a, b_ in zip(copies, stores[0]):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (2, 16)])
def test_reading_slots_back_is_a_gather_and_dequantize_bit_for_bit(monkeypatch, dtype, bits, group):
    """A packed store's read (a tier's evicted tokens on their way to the next tier): one fused
    call, the same values as gathering the slots' codes and dequantizing them."""
    from kvevict.kernels.store import dequantize_from
    from kvevict.storage.rect import PackedStore

    b, h, n, d = 2, 3, 10, 64
    store = PackedStore(b, h, n, d, d, dtype, "cpu", bits, group)
    store.write(
        torch.arange(n).expand(b, h, n), _keys((b, h, n, d), dtype, seed=9), _keys((b, h, n, d), dtype, seed=10)
    )
    idx = torch.tensor([[3, 0, 9, 3]]).expand(b, h, 4)  # any order, repeats allowed
    got = dequantize_from([*store.k.tensors(), *store.v.tensors()], idx, bits, group, dtype)
    assert got is not NotImplemented
    monkeypatch.setenv("KVEVICT_KERNEL", "torch")
    want = store.read(idx)
    for a, w in zip(got, want):
        assert a.dtype == w.dtype == dtype and torch.equal(a, w)
