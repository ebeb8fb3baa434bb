"""torch's foreach kernels in place of megatron-core's local multi-tensor fallbacks: the same
results as the fallbacks they replace, through the optimizer's own entry points; and the
weight-gradient GEMM that stands in for Apex's fused accumulation."""

from __future__ import annotations

import pytest
import torch

from rl_bridge.megatron.multi_tensor import (
    foreach_l2_norm,
    foreach_scale,
    megatron_local_multi_tensor,
    use_foreach_multi_tensor,
    using_foreach_multi_tensor,
)

pytestmark = pytest.mark.unit

SHAPES = [(7,), (3, 5), (64, 33), (1,), (2, 3, 4), (1000,)]


def _tensors(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


@pytest.fixture
def restore_impls():
    from megatron.core.optimizer import clip_grads, optimizer

    saved = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl)
    yield
    clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, optimizer.multi_tensor_scale_impl = saved


def test_l2_norm_equals_megatrons_local_norm() -> None:
    from megatron.core.utils import local_multi_tensor_applier, local_multi_tensor_l2_norm

    from rl_bridge.megatron.cpu_support import cpu_execution

    tensors = _tensors()
    flag = torch.zeros(1, dtype=torch.int)
    with cpu_execution():  # the local version creates its result on "cuda"
        expected, _ = local_multi_tensor_applier(local_multi_tensor_l2_norm, flag, [tensors], False)
    got, per_tensor = local_multi_tensor_applier(foreach_l2_norm, flag, [tensors], False)
    assert per_tensor is None
    assert got.shape == (1,) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(got[0], torch.linalg.vector_norm(torch.cat([t.flatten() for t in tensors])))


def test_l2_norm_of_nothing_is_zero() -> None:
    got, _ = foreach_l2_norm(0, torch.zeros(1, dtype=torch.int), [[]], False)
    assert got.tolist() == [0.0]


def test_scale_in_place_equals_megatrons_local_scale() -> None:
    from megatron.core.utils import local_multi_tensor_scale

    expected, got = _tensors(), _tensors()
    local_multi_tensor_scale(0, None, [expected, expected], 0.37)
    ids = [id(t) for t in got]
    foreach_scale(0, None, [got, got], 0.37)
    assert [id(t) for t in got] == ids
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_scale_into_other_tensors_casts_like_copy(scale: float) -> None:
    """The master-weight copy: fp32 sources into bf16 destinations, rounded as ``copy_`` rounds."""
    from megatron.core.utils import local_multi_tensor_scale

    sources = _tensors(seed=1)
    expected = _tensors(torch.bfloat16, seed=2)
    got = _tensors(torch.bfloat16, seed=2)
    local_multi_tensor_scale(0, None, [sources, expected], scale)
    foreach_scale(0, None, [sources, got], scale)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == torch.bfloat16 and torch.equal(e, g)


def test_scale_refuses_lists_of_different_lengths() -> None:
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        foreach_scale(0, None, [_tensors()[:2], _tensors()[:1]], 1.0)


def test_install_and_restore_through_megatrons_modules(restore_impls) -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    assert megatron_local_multi_tensor()  # no Transformer Engine or Apex here
    assert use_foreach_multi_tensor() is True and using_foreach_multi_tensor()
    assert clip_grads.l2_norm_impl is foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is foreach_scale
    assert optimizer.multi_tensor_scale_impl is foreach_scale
    assert use_foreach_multi_tensor() is True  # idempotent

    # The optimizer's master-weight copy goes through it.
    this, that = _tensors(seed=3), _tensors(torch.bfloat16, seed=4)
    optimizer._multi_tensor_copy_this_to_that(this, that, overflow_buf=torch.zeros(1, dtype=torch.int))
    for t, u in zip(this, that, strict=True):
        assert torch.equal(u, t.to(torch.bfloat16))

    assert use_foreach_multi_tensor(False) is False and not using_foreach_multi_tensor()
    assert clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
    assert optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale
    assert megatron_local_multi_tensor()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_gradient_gemm_accumulates_what_megatrons_unfused_path_adds(dtype: torch.dtype) -> None:
    """The stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` (the fused accumulation itself
    runs on CUDA only): ``main_grad += grad_output^T @ input``, megatron-core's unfused wgrad."""
    from rl_bridge.megatron.fusion import _WeightGradientGemm, fuse_weight_gradient_accumulation

    generator = torch.Generator().manual_seed(0)
    total_input = torch.randn(12, 5, generator=generator).to(dtype)  # [tokens, in]
    grad_output = torch.randn(12, 7, generator=generator).to(dtype)  # [tokens, out]
    main_grad = torch.randn(7, 5, generator=generator).to(dtype)
    expected = main_grad + grad_output.t().matmul(total_input)
    gemm = _WeightGradientGemm
    accumulate = gemm.wgrad_gemm_accum_fp32 if dtype == torch.float32 else gemm.wgrad_gemm_accum_fp16
    storage = main_grad.data_ptr()
    accumulate(total_input, grad_output, main_grad)
    assert main_grad.data_ptr() == storage  # in place, as megatron-core expects of the buffer
    torch.testing.assert_close(main_grad, expected)
    assert fuse_weight_gradient_accumulation(torch.nn.Linear(2, 2)) == 0  # nothing on CPU
