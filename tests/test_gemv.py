"""The batch-1 projection kernel (flexsgl/kernels/gemv.py) against float64.

Every prologue (none, RMSNorm, SiLU gate) with and without bias and residual, on shapes where K is
a multiple of the tile and where it is not, N a multiple of the row block and not, and one of each
tile configuration the engine picks. On the GPU, compiled: bfloat16 and float16, and bfloat16
launched with PDL (flexsgl/kernels/launch.py). On the CPU, through Triton's interpreter: float16
and float32 (tests/conftest.py says why not bfloat16), on shapes small enough for it (it runs a
program at a time in Python); with PDL too, its grid-dependency waits stubbed out (the interpreter
does not model them), so the first weight slice, loaded ahead and multiplied before the loop, is
checked there as well. The output is poisoned with
NaN first, so an unwritten element fails. 16-bit operands with a float32 accumulator land well
under 1e-2. FP8 weights (float8_e4m3fn, a float32 scale per row) against float64 products of the
same FP8 values and scales: bfloat16 x on the GPU, float16 and float32 x through the interpreter.
"""

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flexsgl.kernels import gemv
from flexsgl.model.layers import RMSNorm
from flexsgl.quant.fp8 import quantize_rows
from tests.fp8_checkpoints import quantize

# (N, K): K a multiple of every BLOCK_K or not; N a multiple of BLOCK_N or not; each config_for branch.
SHAPES = [(6144, 4096), (4100, 1000), (37, 3072), (24580, 2048), (4096, 12300), (151936, 1024)]
# On the CPU, smaller: every tile but lm_head's (8k programs at least). The interpreter ignores warps
# and stages, in which alone gate_up's configuration differs from qkv's.
CPU_SHAPES = [(40, 1024), (37, 1000), (600, 512), (6, 8200)]
PROLOGUES = gemv.PROLOGUES


def reference(prologue, x, w, bias, residual, norm_weight, eps):
    x = x.double()
    if prologue == gemv.RMS_NORM:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    elif prologue == gemv.SILU_GATE:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    out = x @ w.double().T
    for extra in (bias, residual):
        if extra is not None:
            out = out + extra.double()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("prologue", list(PROLOGUES))
@pytest.mark.parametrize("extras", [False, True], ids=["alone", "bias+residual"])
@pytest.mark.parametrize("dtype,use_pdl", [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)],
                         ids=["bf16", "fp16", "bf16-pdl"])
def test_kernel_matches_float64(n, k, prologue, extras, dtype, use_pdl):
    check_kernel("cuda", n, k, prologue, extras, dtype, use_pdl)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("n,k", CPU_SHAPES)
@pytest.mark.parametrize("prologue", list(PROLOGUES))
@pytest.mark.parametrize("extras", [False, True], ids=["alone", "bias+residual"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])  # bf16: see conftest
def test_interpreted_kernel_matches_float64(n, k, prologue, extras, dtype):
    check_kernel("cpu", n, k, prologue, extras, dtype, use_pdl=False)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("prologue", list(PROLOGUES))
@pytest.mark.parametrize("extras", [False, True], ids=["alone", "bias+residual"])
@pytest.mark.parametrize("use_pdl", [False, True], ids=["plain", "pdl"])
def test_fp8_weights_match_float64(n, k, prologue, extras, use_pdl):
    check_kernel("cuda", n, k, prologue, extras, torch.bfloat16, use_pdl, fp8=True)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("n,k", CPU_SHAPES)
@pytest.mark.parametrize("prologue", list(PROLOGUES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_interpreted_fp8_weights_match_float64(n, k, prologue, dtype):
    check_kernel("cpu", n, k, prologue, True, dtype, use_pdl=False, fp8=True)


@pytest.fixture
def interpreted_pdl(monkeypatch):
    """PDL's grid-dependency calls as no-ops, for kernels run by Triton's interpreter."""
    import triton.language as tl

    for name in ("gdc_wait", "gdc_launch_dependents"):
        monkeypatch.setattr(tl.extra.cuda, name, lambda *args, **kwargs: None)


@pytest.mark.usefixtures("triton_interpreter", "interpreted_pdl")
@pytest.mark.parametrize("n,k", [(37, 300), (40, 1024), (6, 8200)])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_interpreted_kernel_with_pdl_matches_float64(n, k, fp8):
    """With PDL the first slice takes its own path: all of a short K, or the first of several slices
    (whole ones, or with a partial last)."""
    for prologue in PROLOGUES:
        check_kernel("cpu", n, k, prologue, True, torch.float32, use_pdl=True, fp8=fp8)


# (N, K) of block-scaled FP8 weights: 128 x 128 blocks on the GPU (an 8B's qkv, o and down), smaller
# blocks (32 x 64) on the CPU; each with every prologue that projection takes.
BLOCK_SHAPES = [(6144, 4096, "rms_norm"), (4096, 4096, "plain"), (4096, 12288, "silu_gate")]
CPU_BLOCK_SHAPES = [(64, 1024, "rms_norm"), (96, 512, "plain"), (32, 8192, "silu_gate")]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,prologue", BLOCK_SHAPES)
def test_fp8_block_scaled_weights_match_float64(n, k, prologue):
    check_kernel("cuda", n, k, prologue, True, torch.bfloat16, True, fp8=(128, 128))


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("n,k,prologue", CPU_BLOCK_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_interpreted_fp8_block_scaled_weights_match_float64(n, k, prologue, dtype):
    """Weights scaled per block (block-wise checkpoints): the kernel scales x by its row block's scale
    of each column block, a program's rows all in one row block."""
    check_kernel("cpu", n, k, prologue, True, dtype, use_pdl=False, fp8=(32, 64))


def test_register_cap_only_where_triton_specialises_every_size_and_address():
    """FP8 launches cap registers where the weight's sizes, row stride and every tensor's address are
    multiples of 16, and nowhere else (an unspecialised kernel would spill under the cap)."""
    fp8 = torch.empty(64, 256, dtype=gemv.FP8)
    x, out = torch.empty(1, 256, dtype=torch.bfloat16), torch.empty(1, 64, dtype=torch.bfloat16)
    capped = {"maxnreg": gemv.FP8_MAX_REGISTERS}
    assert gemv.register_cap(fp8, x, out, None) == capped
    assert gemv.register_cap(fp8.to(torch.bfloat16), x, out) == {}  # not FP8
    assert gemv.register_cap(torch.empty(64, 200, dtype=gemv.FP8), x, out) == {}  # K of 200
    assert gemv.register_cap(torch.empty(60, 256, dtype=gemv.FP8), x, out) == {}  # N of 60
    assert gemv.register_cap(torch.empty(64, 264, dtype=gemv.FP8)[:, :256], x, out) == {}  # row stride 264
    assert gemv.register_cap(fp8, torch.empty(1, 257, dtype=torch.bfloat16)[:, 1:], out) == {}  # x 2 bytes in
    assert gemv.register_cap(fp8, x, out, torch.empty(65, dtype=torch.float32)[1:]) == {}  # a scale 4 bytes in


def check_kernel(device, n, k, prologue, extras, dtype, use_pdl, fp8=False):
    """fp8: True for a scale per row, (bn, bk) for one per block (tests/fp8_checkpoints.py's quantizer)."""
    seed = random.randrange(1 << 30)
    g = torch.Generator(device=device).manual_seed(seed)
    p = PROLOGUES[prologue]
    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
    x = rand(1, 2 * k if p == gemv.SILU_GATE else k)
    w = (rand(n, k) / k ** 0.5).to(dtype)
    scale, weight = None, w
    if fp8 is True:  # rows of different magnitudes, so a scale applied to the wrong row shows
        w, scale = quantize_rows(w * (0.1 + torch.rand(n, 1, device=device, generator=g)))
        scale = scale.view(-1)
        weight = w.double() * scale.double()[:, None]
    elif fp8:  # blocks of different magnitudes, so a scale applied to the wrong block shows
        (bn, bk) = fp8
        w = w * (0.1 + torch.rand(n // bn, k // bk, device=device, generator=g)).repeat_interleave(bn, 0) \
            .repeat_interleave(bk, 1)
        w, scale, weight = quantize(w.cpu(), "block", fp8)
        w, scale, weight = w.to(device), scale.to(device), weight.double().to(device)
    bias, residual = (rand(n), rand(1, n)) if extras else (None, None)
    norm_weight = (0.5 + torch.rand(k, device=device, generator=g)).to(dtype) if p == gemv.RMS_NORM else None
    out = torch.full((1, n), float("nan"), device=device, dtype=dtype)
    gemv.launch(x, w, bias, out, residual=residual, norm_weight=norm_weight, eps=1e-6, prologue=p, use_pdl=use_pdl,
                scale=scale)
    ref = reference(p, x, weight, bias, residual, norm_weight, 1e-6)
    assert not out.isnan().any(), f"unwritten outputs (seed={seed})"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert err < tol, f"relative error {err:.2e} (seed={seed})"


@pytest.mark.gpu
@torch.no_grad()
def test_fused_projections_at_batch_1_and_beyond():
    """norm_linear, linear and silu_linear through the kernel (batch 1) and through PyTorch
    (batch 3), eager and compiled with fullgraph, against the same expressions in float64."""
    torch.manual_seed(seed := random.randrange(1 << 30))
    norm = RMSNorm(512, 1e-6).cuda()
    norm.weight.data.uniform_(0.5, 1.5)
    proj, down = nn.Linear(512, 256, bias=True).cuda(), nn.Linear(256, 512, bias=False).cuda()
    x, res, gate_up = (torch.randn(3, n, device="cuda") for n in (512, 512, 512))
    modules = {"norm": norm, "proj": proj, "down": down}
    wide = {k: copy.deepcopy(m).double() for k, m in modules.items()}
    low = {k: copy.deepcopy(m).to(torch.bfloat16) for k, m in modules.items()}
    assert gemv.applies(x[:1].bfloat16(), low["proj"].weight) and not gemv.applies(x[:2].bfloat16(), low["proj"].weight)
    assert not gemv.applies(x[:1], proj.weight)  # float32 stays with PyTorch
    cases = {
        "norm_linear": (lambda m, x, r, gu: gemv.norm_linear(x, m["norm"], m["proj"]),
                        lambda m, x, r, gu: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
                        @ (m["proj"].weight * m["norm"].weight).T + m["proj"].bias),
        "linear": (lambda m, x, r, gu: gemv.linear(gu[:, :256], m["down"], r),
                   lambda m, x, r, gu: r + gu[:, :256] @ m["down"].weight.T),
        "silu_linear": (lambda m, x, r, gu: gemv.silu_linear(gu, m["down"], r),
                        lambda m, x, r, gu: r + (F.silu(gu[:, :256]) * gu[:, 256:]) @ m["down"].weight.T),
    }
    for name, (fused, ref_fn) in cases.items():
        ref = ref_fn(wide, x.double(), res.double(), gate_up.double())
        for rows in (1, 3):
            args = (x[:rows].bfloat16(), res[:rows].bfloat16(), gate_up[:rows].bfloat16())
            for fn in (fused, torch.compile(fused, fullgraph=True, dynamic=False)):
                out = fn(low, *args)
                err = ((out.double() - ref[:rows]).norm() / ref[:rows].norm()).item()
                assert err < 1e-2, f"{name}, rows={rows}: relative error {err:.2e}"


def check_stacked(device, e, n, k, slots, dtype):
    """stacked_gemv against float64: slot s's output row from its own weight of the stack, chosen by
    a shuffled index, and its own x row."""
    seed = random.randrange(1 << 30)
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(e, n, k, device=device, generator=g) / k ** 0.5).to(dtype)
    index = torch.randperm(e, device=device, generator=g)[:slots]
    x = torch.randn(slots, k, device=device, generator=g).to(dtype)
    out = torch.full((slots, n), float("nan"), device=device, dtype=dtype)
    gemv.launch_stacked(x, w, index, out)
    for s in range(slots):
        ref = x[s].double() @ w[index[s]].double().T
        got = out[s].double()
        assert not got.isnan().any(), f"slot {s}: unwritten outputs (seed={seed})"
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"slot {s}: relative error {err:.2e} (seed={seed})"


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_interpreted_stacked_kernel_matches_float64(dtype):
    check_stacked("cpu", 8, 40, 1000, 3, dtype)


@pytest.mark.gpu
def test_stacked_kernel_matches_float64():
    """MLA's W_UV at DeepSeek-V2-Lite's sizes: 16 heads' [128, 512] slices, a slot per head."""
    check_stacked("cuda", 16, 128, 512, 16, torch.bfloat16)
