"""The store path's Triton programs (kvevict.kernels.triton_store) held bit for bit to the torch
reference, run on the CPU in triton's interpreter (TRITON_INTERPRET=1, set before triton is first
imported; on a GPU with TRITON_INTERPRET=0 the same checks run compiled)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (pip install 'kvevict[triton]')")

from kvevict.kernels.store import quantize_pair, rotate_reference  # noqa: E402
from kvevict.kernels.triton_decode import interpreting  # noqa: E402
from kvevict.kernels.triton_store import quantize_into_triton, rotate_triton  # noqa: E402
from kvevict.storage.rect import PackedStore, scatter  # noqa: E402

DEVICE = "cpu" if interpreting() else "cuda"
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(),
    reason="triton's interpreter is off (TRITON_INTERPRET must be 1 before triton is first imported) and there is no GPU",
)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _tokens(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 40
    flat = x.view(-1, shape[-1])
    flat[0] = 0
    flat[1] = -flat[1].abs() - 2  # all negative: the grid's bottom below the maximum
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128, 96])
def test_the_rotation_program_is_the_reference_bit_for_bit(dtype, d):
    x = _tokens((3, 2, 5, d), dtype, 0)
    c = (torch.randn(3, 2, d, generator=torch.Generator().manual_seed(1)) * 20).half().to(DEVICE)
    assert torch.equal(rotate_triton(x), rotate_reference(x))
    assert torch.equal(rotate_triton(x, c), rotate_reference(x - c.unsqueeze(2).to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("with_take", [False, True])
def test_the_quantized_write_is_quantize_pair_and_a_scatter(dtype, bits, with_take):
    g = torch.Generator().manual_seed(2)
    b, h, n, j, d = 2, 3, 9, 4, 64
    idx = torch.stack([torch.randperm(n, generator=g)[:j] for _ in range(b * h)]).view(b, h, j).to(DEVICE)
    k, v = _tokens((b, h, j, d), dtype, 3), _tokens((b, h, j, d), dtype, 4)
    take = (torch.rand(b, h, j, generator=g) > 0.3).to(DEVICE) if with_take else None
    store = PackedStore(b, h, n, d, d, dtype, DEVICE, bits, 32)
    stores = [*store.k.tensors(), *store.v.tensors()]
    want = [t.clone() for t in stores]
    for t, src in zip(want, quantize_pair(k, v, bits, 32)):
        scatter(t, idx, src, take)
    assert quantize_into_triton(stores, idx, k, v, bits, 32, take) is None
    for got, ref in zip(stores, want):
        assert torch.equal(got, ref)


def test_a_head_size_that_is_not_a_power_of_two_is_left_to_the_torch_path():
    k = _tokens((1, 1, 2, 96), torch.float32, 5)
    store = PackedStore(1, 1, 4, 96, 96, torch.float32, DEVICE, 4, 32)
    idx = torch.tensor([[[0, 2]]], device=DEVICE)
    assert quantize_into_triton([*store.k.tensors(), *store.v.tensors()], idx, k, k, 4, 32) is NotImplemented


def test_the_programs_are_checked_against_the_reference_before_their_first_use():
    from kvevict.kernels.store_check import agrees

    assert agrees(DEVICE) == (True, "")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (2, 16)])
def test_the_read_program_is_a_gather_and_dequantize(dtype, bits, group):
    from kvevict.kernels.triton_store import dequantize_from_triton
    from kvevict.storage.codes import dequantize

    b, h, n, d = 2, 3, 8, 64
    store = PackedStore(b, h, n, d, d, dtype, DEVICE, bits, group)
    idx_all = torch.arange(n, device=DEVICE).expand(b, h, n)
    stores = [*store.k.tensors(), *store.v.tensors()]
    for t, src in zip(
        stores, quantize_pair(_tokens((b, h, n, d), dtype, 6), _tokens((b, h, n, d), dtype, 7), bits, group)
    ):
        scatter(t, idx_all, src)
    idx = torch.tensor([[5, 0, 7, 5]], device=DEVICE).expand(b, h, 4)
    got = dequantize_from_triton(stores, idx, bits, group, dtype)
    for part, out in zip((stores[:3], stores[3:]), got):
        gathered = [t.gather(2, idx.unsqueeze(-1).expand(*idx.shape, t.shape[-1])) for t in part]
        assert out.dtype == dtype and torch.equal(out, dequantize(*gathered, bits, group, dtype))
