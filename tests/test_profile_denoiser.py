"""bench.profile_denoiser without a GPU: kernel names as the profiler reports them, sorted into families;
the summary and its table; and the refusal to run where there is no GPU."""

import pytest

from bench.profile_denoiser import FAMILIES, is_ours, kernel_family, main, markdown, summarize

KERNELS = {
    "gemm": [
        "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
        "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTT",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align8>"
        "(cutlass_80_wmma_tensorop_f16_s161616gemm_f16_32x32_128x2_tn_align8::Params)",
        "ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_32x5_tn",
        "void splitKreduce_kernel<32, 16, int, float, __half, float, __half, true, false, false>"
        "(cublasSplitKParams<float>, float const*, __half const*, __half*, float const*, float const*, __half const*)",
        "void gemv2T_kernel_val<int, int, __half, __half, float, float, 128, 16, 4, 4, false, false>(...)",
        "triton_tem_fused_addmm_7",
        "triton_tem_fused_mm_0",
        "sm80_xmma_gemm_f16f16_f16f16_f16_nn_n_tilesize96x128x32_stage4_warpsize2x2x1_tensor16x8x16_execute_kernel_trt",
    ],
    "attention": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4, false, false, cutlass::half_t, "
        "Flash_kernel_traits<64, 128, 64, 4, cutlass::half_t> >, false, false, false, false, true, true, false, false>"
        "(pytorch_flash::Flash_fwd_params)",
        "fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::half_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_kernel0_0",
        "void sdp::(anonymous namespace)::attention_kernel<sdp::(anonymous namespace)::Tile<40, 64, 64, 4> >"
        "(sdp::(anonymous namespace)::AttentionParams)",
        "void sdp::(anonymous namespace)::short_kv_attention_kernel<sdp::(anonymous namespace)::ShortKV<64> >"
        "(sdp::(anonymous namespace)::AttentionParams, int)",
        "void (anonymous namespace)::softmax_warp_forward<c10::Half, c10::Half, float, 7, false, false>"
        "(c10::Half*, c10::Half const*, int, int, int, bool const*, int, bool)",
        "fmha_v2_flash_attention_fp16_64_128_S_40_sm90_kernel_nl",
    ],
    "conv": [
        "void implicit_convolve_sgemm<float, float, 128, 5, 5, 3, 3, 3, 1, false, false, true>(int, int, int, "
        "float const*, int, float*, float const*, kernel_conv_params, unsigned long long, int, float, float, int)",
        "sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1_g1_"
        "execute_kernel__5x_cudnn",
        "sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x32x64_stage1_"
        "warpsize4x1x1_g1_tensor16x8x16_alignc4_execute_kernel__5x_cudnn",
        "void cudnn::ops::nchwToNhwcKernel<__half, __half, float, false, true, (cudnnKernelDataType_t)0>"
        "(cudnn::ops::nchw2nhwc_params_t<float>, __half const*, __half*)",
        "void cudnn::cnn::conv2d_grouped_direct_kernel<false, true, false, false, 0, 0, int, __half, __half, float>"
        "(...)",
        "triton_tem_fused_convolution_2",
    ],
    "norm": [
        "void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<c10::Half, float>"
        "(long, float, c10::Half const*, float*, float*)",
        "void at::native::(anonymous namespace)::ComputeFusedParamsCUDAKernel<c10::Half, float>(...)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float, false>"
        "(int, float, c10::Half const*, c10::Half const*, c10::Half const*, float*, float*, c10::Half*)",
        "triton_red_fused_native_group_norm_3",
        "triton_per_fused_native_layer_norm_2",
        "triton_poi_fused_native_group_norm_silu_4",
        "void sdp::(anonymous namespace)::nchw_fused<true>(sdp::(anonymous namespace)::Problem)",
        "void sdp::(anonymous namespace)::nhwc_apply<true>(sdp::(anonymous namespace)::Problem)",
        "void sdp::(anonymous namespace)::finalize(sdp::(anonymous namespace)::Problem)",
        "void sdp::(anonymous namespace)::layer_norm_warp<8>(__half const*, __half const*, __half const*, __half*, "
        "long, int, float)",
        "void sdp::(anonymous namespace)::rms_norm_rows<1, 8>(__half const*, __half const*, __half*, long, int, float)",
        "void sdp::(anonymous namespace)::ada_layer_norm_block<8>(__half const*, __half const*, __half const*, "
        "__half*, long, int, float)",
        "void groupNormNHWCScaleKernel<__half, 160>(GroupNormNHWCParams<__half>)",
    ],
    "elementwise/other": [
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>, "
        "std::array<char*, 3ul> >"
        "(int, at::native::CUDAFunctor_add<c10::Half>, std::array<char*, 3ul>)",
        "void at::native::elementwise_kernel<128, 2, "
        "at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda>"
        "(at::TensorIteratorBase&)>(int, at::native::gpu_kernel_impl_nocast)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<"
        "at::native::(anonymous namespace)::OpaqueType<2u>, "
        "unsigned int, 4, 64, 64>(...)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::normal_kernel<c10::Half>, "
        "std::array<char*, 1ul> >",
        "triton_poi_fused_convolution_silu_5",
        "triton_poi_fused_add_mul_0",
        "void sdp::(anonymous namespace)::split_gelu_kernel<8>(__half const*, __half const*, __half*, long, int)",
        "void sdp::(anonymous namespace)::seq2spatial_kernel(__half const*, __half const*, __half const*, __half*, "
        "int, int)",
        "void sdp::(anonymous namespace)::gelu_tanh_kernel<8, true>(__half const*, __half const*, __half*, long, int)",
        "__myl_AddMulSig_0x5c1e",
    ],
    "memcpy": ["Memcpy DtoD (Device -> Device)", "Memset (Device)", "Memcpy HtoD (Pageable -> Device)"],
}


@pytest.mark.parametrize("family, name", [(f, n) for f, names in KERNELS.items() for n in names])
def test_kernel_families(family, name):
    assert kernel_family(name) == family


def test_our_kernels_are_told_apart():
    assert all(is_ours(name) == ("sdp::" in name) for names in KERNELS.values() for name in names)
    assert sum(is_ours(name) for names in KERNELS.values() for name in names) == 11
    assert set(KERNELS) == set(FAMILIES)


def test_summary_shares_and_table():
    kernels = [(KERNELS["gemm"][0], 600.0, 20), (KERNELS["attention"][3], 250.0, 10), (KERNELS["conv"][1], 100.0, 40),
               (KERNELS["memcpy"][0], 50.0, 10)]
    profile = summarize(kernels, steps=10, elapsed_ms=2.0)
    families = profile["families"]
    assert families["gemm"]["share"] == pytest.approx(0.6) and families["attention"]["share"] == pytest.approx(0.25)
    assert families["norm"]["ms"] == 0 and sum(f["share"] for f in families.values()) == pytest.approx(1.0)
    assert families["attention"]["ours_ms"] == pytest.approx(0.25) and profile["ours_ms"] == pytest.approx(0.25)
    assert profile["kernel_ms_per_step"] == pytest.approx(0.1) and profile["gpu_busy"] == pytest.approx(0.5)
    assert [k["family"] for k in profile["kernels"]] == ["gemm", "attention", "conv", "memcpy"]
    table = markdown({**profile, "gpu": "NVIDIA H100", "model": "sd1.5-arch + sd15-controlnet-arch",
                      "workload": "512x512, UNet batch 2", "settings_text": "eager", "torch": "2.11"})
    assert table.startswith("UNet profile on NVIDIA H100: sd1.5-arch + sd15-controlnet-arch, 512x512, UNet batch 2")
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1].startswith("| gemm | 0.060 | 60.0% | 1 | 2.0 | 0.000 |")
    assert rows[2].startswith("| attention | 0.025 | 25.0% | 1 | 1.0 | 0.025 |")


def test_needs_a_gpu(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["--model", "tiny", "--controlnet", "tiny-controlnet", "--results-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0]
    assert not (tmp_path / "r").exists()
    assert main(["--steps", "0"]) == 2


def test_a_step_runs_the_controlnets_and_the_unet_on_their_residuals():
    """The profiled step with --controlnet: the ControlNet's call, then the UNet's on its residuals (whose output
    therefore differs from the UNet's alone on the same inputs); without ControlNets, the UNet's alone."""
    import torch

    from bench.profile_denoiser import denoiser_step
    from demo.runtime.loader import load_pipeline
    from demo.runtime.spec import PipelineSpec

    cpu = torch.device("cpu")
    steered = load_pipeline(PipelineSpec(model="tiny", backend="torch", precision="fp32", stages=("unet",),
                                         controlnets=(("tiny-controlnet", 1.0),)), cpu)
    plain = load_pipeline(PipelineSpec(model="tiny", backend="torch", precision="fp32", stages=("unet",)), cpu)
    assert sorted(steered.stages) == ["controlnet0", "controlnet0_image", "unet"]  # the image's: once per call
    with_residuals = denoiser_step(steered.stages, "unet", 2, 64, 64, cpu, torch.float32)()["latent"]
    alone = denoiser_step(plain.stages, "unet", 2, 64, 64, cpu, torch.float32)()["latent"]
    assert with_residuals.shape == alone.shape and alone.shape[:2] == (2, 4)
    assert not torch.allclose(with_residuals, alone)


def test_a_transformer_step_runs_the_family_denoiser_at_its_batch():
    """A Flux model's profiled step is its transformer's call (one half: Flux's guidance is embedded)."""
    import torch

    from bench.profile_denoiser import denoiser_step
    from demo.runtime.loader import load_pipeline
    from demo.runtime.spec import PipelineSpec

    cpu = torch.device("cpu")
    flux = load_pipeline(PipelineSpec(model="tiny-flux", backend="torch", precision="fp32",
                                      stages=("flux_transformer",)), cpu)
    out = denoiser_step(flux.stages, "flux_transformer", 1, 64, 64, cpu, torch.float32)()["latent"]
    assert out.shape[0] == 1 and torch.isfinite(out).all() and out.abs().sum() > 0
