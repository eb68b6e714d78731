"""Device-agnostic code on CUDA: the same steps on GPU and CPU agree (skipped without a GPU)."""

import pytest
import torch

from fira_optim import FiraAdamW

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("projector", ["svd", "randomized"])
def test_cuda_matches_cpu(dtype, projector):
    shapes = [(64, 96), (96, 64), (48, 48)]
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(7)]
    results = {}
    for device in ("cpu", "cuda"):
        # copy=True: on the CPU, .to() would return init itself and the run would train it in place
        params = [torch.nn.Parameter(w.to(device=device, dtype=dtype, copy=True)) for w in init]
        # aligned signs: LAPACK and cuSOLVER may return a singular vector with opposite signs, and
        # with raw signs the carried moments would then be read in a flipped basis
        opt = FiraAdamW([{"params": params, "rank": 8}], lr=1e-2, update_proj_gap=3,
                        projector=projector, seed=1, align_signs=True)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(device=device, dtype=dtype)
            opt.step()
        for p in params:
            assert p.dtype == dtype and p.device.type == device
            assert opt.state[p]["basis"].dtype == torch.float32  # SVD and states in fp32
        results[device] = [p.detach().float().cpu().clone() for p in params]
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}[dtype]
    for a, b in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_state_moves_with_the_optimizer_to_cuda():
    p_cpu = torch.nn.Parameter(torch.randn(32, 48))
    opt = FiraAdamW([{"params": [p_cpu], "rank": 4}], lr=1e-2)
    p_cpu.grad = torch.randn(32, 48)
    opt.step()
    p_gpu = torch.nn.Parameter(p_cpu.detach().cuda())
    opt2 = FiraAdamW([{"params": [p_gpu], "rank": 4}], lr=1e-2)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.state[p_gpu]["basis"].device.type == "cuda"
    p_gpu.grad = torch.randn(32, 48, device="cuda")
    opt2.step()
    assert torch.isfinite(p_gpu).all()


def test_compiled_kernel_matches_the_fast_path_on_cuda():
    import fira_optim.compiled as compiled

    shapes = [(64, 96), (96, 64)]
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(6)]
    results = {}
    for implementation in ("fast", "compiled"):
        params = [torch.nn.Parameter(w.to("cuda", copy=True)) for w in init]
        opt = FiraAdamW([{"params": params, "rank": 8}], lr=1e-2, update_proj_gap=3,
                        weight_decay=0.1, implementation=implementation)
        for row in grads:
            for p, g in zip(params, row):
                p.grad = g.cuda()
            opt.step()
        results[implementation] = [p.detach().cpu() for p in params]
    assert compiled._failed is None, compiled._failed  # Triton compiled and ran the kernel
    for a, b in zip(results["fast"], results["compiled"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_host_refresh_decomposes_cuda_gradients_on_the_host(monkeypatch):
    """host_refresh: the SVDs of CUDA gradients run on the CPU in the refresh pool, and the
    bases are the CPU run's bit for bit (same gradients, same host SVDs), back on the GPU."""
    import fira_optim.projection as projection

    shapes = [(64, 96), (96, 64), (48, 48)]
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(7)]
    svd = torch.linalg.svd
    devices = []
    monkeypatch.setattr(projection.torch.linalg, "svd",
                        lambda a, **kw: devices.append(a.device.type) or svd(a, **kw))
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # the pool needs two threads
    bases = {}
    try:
        for device, host_refresh in (("cpu", False), ("cuda", True)):
            params = [torch.nn.Parameter(w.to(device, copy=True)) for w in init]
            opt = FiraAdamW([{"params": params, "rank": 8}], lr=1e-2, update_proj_gap=3,
                            host_refresh=host_refresh)
            bases[device] = []
            for row in grads:
                for p, g in zip(params, row):
                    p.grad = g.to(device)
                opt.step()
                bases[device].append([opt.state[p]["basis"].detach().cpu().clone() for p in params])
            assert all(opt.state[p]["basis"].device.type == device for p in params)
    finally:
        torch.set_num_threads(threads)
    assert devices and set(devices) == {"cpu"}  # no SVD ran on the GPU
    for step_cpu, step_cuda in zip(bases["cpu"], bases["cuda"]):
        for a, b in zip(step_cpu, step_cuda):
            assert torch.equal(a, b)


def test_fp16_loss_scaling_in_backward_matches_gradscaler_on_cuda():
    """fp16 autocast on the GPU: the handle's per-update scaling against GradScaler and a plain
    step (bit for bit, as on the CPU), the scale growing every 2 steps."""
    from tests.fira_optim.test_loss_scale import _scaled_training

    (m1, _, s1), (m2, _, s2) = (_scaled_training(b, 7, True, unfreeze_at=2, device="cuda", autocast=True)
                                for b in (False, True))
    assert s1 == s2
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_fused_adamw_for_the_plain_parameters_matches_torchs_on_cuda():
    """torch's fused CUDA kernel reads the step counts on the device; this optimizer keeps them on
    the host (it passes device copies). Bitwise torch.optim.AdamW(fused=True), through a
    state_dict round trip too."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 32, device="cuda"), torch.randn(32, device="cuda")]
    ours = [torch.nn.Parameter(w.clone()) for w in weights]
    theirs = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = FiraAdamW([{"params": ours, "rank": None}], lr=1e-2, weight_decay=0.1, fused=True)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(4):
        if step == 2:
            opt.load_state_dict(opt.state_dict())
        grads = [torch.randn_like(w) for w in weights]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 4


@pytest.mark.parametrize("rounding", [False, True], ids=["nearest", "stochastic"])
def test_a_bf16_matrix_step_on_cuda_holds_its_fp32_gradient_and_one_working_copy(rounding):
    """The fast path's bf16 step on CUDA allocates the matrix's fp32 gradient and one fp32
    working copy of it, plus rank-sized terms (and a chunk of rounding noise): the reference
    path's explicit S and update held several fp32 matrices more."""
    rows, cols, rank = 2048, 4096, 64
    peaks = {}
    for implementation in ("fast", "reference"):
        w = torch.nn.Parameter(torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16))
        opt = FiraAdamW([{"params": [w], "rank": rank, "update_proj_gap": 1000}], lr=1e-3,
                        implementation=implementation, stochastic_rounding=rounding)
        for _ in range(2):
            w.grad = torch.randn_like(w)
            opt.step()
        w.grad = torch.randn_like(w)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        opt.step()
        torch.cuda.synchronize()
        peaks[implementation] = (torch.cuda.max_memory_allocated() - before) / (rows * cols)
        del w, opt
    # 8 bytes per element (gradient and copy), and the noise of stochastic rounding: 6 while it is
    # drawn (the matrix is under one 16M-element chunk on CUDA); rank-sized terms, 0.1 here
    assert peaks["fast"] <= 8 + 6 * rounding + 2, peaks
    assert peaks["reference"] >= peaks["fast"] + 6, peaks  # on the CPU: 31 against 11
