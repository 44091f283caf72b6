"""--profile's time by kind of work: kernel and operator names sorted into kinds."""

import pytest

from trainer.modes import OTHER, kind_of


@pytest.mark.parametrize(
    "name, kind",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_kernel__5x_cublas", "matmul"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNN", "matmul"),
        ("triton_tem_fused_addmm_3", "matmul"),
        ("aten::addmm", "matmul"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t>>", "attention"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float>, float>", "optimizer"),
        ("aten::_foreach_mul_", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("Memcpy HtoD (Pageable -> Device)", "copies"),
        ("aten::_to_copy", "copies"),
        ("triton_per_fused_native_layer_norm_0", OTHER),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", OTHER),
        ("aten::topk", OTHER),
        ("aten::gather", OTHER),
    ],
)  # fmt: skip
def test_kernel_and_operator_names_fall_into_kinds(name, kind):
    assert kind_of(name) == kind
