"""--profile's time by kind of work: kernel and operator names sorted into kinds."""

import pytest

from trainer.run.profile import OTHER, kind_of


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


def test_time_by_kind_counts_kernels_not_the_ranges_over_them():
    """torch.compile records "## Call CompiledFxGraph ..." as a device-side range over its kernels; the
    GPU line counts kernels once (an H100 profile read 122% busy and 65% elementwise with them)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from trainer.run.profile import time_by_kind

    def ev(key, us):
        return SimpleNamespace(
            key=key, device_type=DeviceType.CUDA, self_device_time_total=us, device_time_total=us
        )

    events = [
        ev("## Call CompiledFxGraph fbg2bkx", 700.0),
        ev("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_bias_NNN", 400.0),
        ev("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 200.0),
        ev("triton_poi_fused__to_copy_15", 100.0),
        ev("ProfilerStep#4", 900.0),
    ]
    line = time_by_kind(events, cuda=True, wall=0.001)
    assert "GPU kernels 0.001 s in 0.001 s (busy 70%" in line.replace(" of traced steps", ""), line
    assert "matmul 57%, attention 29%, elementwise and reductions 14%" in line, line
