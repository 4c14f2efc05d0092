"""flexsgl/kernels/block_fp8_experts.py: routed experts' products over block-scaled FP8 weights,
against float64 products of the weights they stand for (tests/fp8_checkpoints.py's quantizer): the
kernel alone on segments that are empty, shorter than a tile and several tiles long, and the MoE
layer's grouped path through it. On the CPU through Triton's interpreter in float32, on the GPU in
bfloat16 at DeepSeek-V3's 128 x 128 blocks."""

import random

import pytest
import torch

import flexsgl.model.moe as moe_module
from flexsgl.kernels import block_fp8_experts, gemv
from tests.fp8_checkpoints import quantize
from tests.test_moe import HIDDEN, hold_fp8, one_token_moe, reference


def check_kernel(device, dtype, experts, n, k, block, counts, tol):
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    # experts of different magnitudes, blocks too: a scale read for the wrong expert or block shows
    w = torch.randn(experts, n, k) * torch.rand(experts, n // block[0], k // block[1]).add(0.1) \
        .repeat_interleave(block[0], 1).repeat_interleave(block[1], 2)
    q, scale, deq = (torch.stack(t) for t in zip(*(quantize(w[e], "block", block) for e in range(experts))))
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    a = torch.randn(int(ends[-1]), k).to(dtype)
    out = block_fp8_experts.launch(a.to(device), q.to(device), scale.to(device), ends.to(device))
    ref, start = torch.empty(a.shape[0], n, dtype=torch.float64), 0
    for e, end in enumerate(ends.tolist()):
        ref[start:end] = a[start:end].double() @ deq[e].double().T
        start = end
    assert out.dtype == dtype and out.shape == ref.shape
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < tol, f"seed={seed}: relative error {err:.2e}"


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("counts", [[7, 0, 20, 1, 9], [0, 0, 130, 3, 0]], ids=["short", "long"])
def test_interpreted_kernel_matches_float64(counts):
    """Empty segments, segments shorter than a tile of 64 rows, and one of three tiles."""
    check_kernel("cpu", torch.float32, 5, 64, 48, (32, 16), counts, 1e-5)


@pytest.mark.usefixtures("triton_interpreter")
def test_block_product_below_four_blocks_runs_the_kernel():
    """Fp8Linear's block-scaled product at K of 2 blocks (where torch._scaled_mm's block recipe sums
    wrongly) is the kernel over one group of every row, x as it is: against float64."""
    from flexsgl.quant.fp8_linear import block_product

    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    w = torch.randn(256, 256) * torch.rand(2, 2).add(0.1).repeat_interleave(128, 0).repeat_interleave(128, 1)
    q, scale, deq = quantize(w, "block", (128, 128))
    x, bias = torch.randn(5, 256), torch.randn(256)
    out = block_product(x, q, scale, bias)
    ref = x.double() @ deq.double().T + bias.double()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, f"seed={seed}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 33, 2000])
def test_kernel_in_bf16_on_gpu(tokens):
    """128 experts of Qwen3-30B-A3B's down projection [2048, 768] and 128 x 128 blocks, 8 a token."""
    rng = random.Random(tokens)
    chosen = [rng.randrange(128) for _ in range(8 * tokens)]
    counts = [chosen.count(e) for e in range(128)]
    check_kernel("cuda", torch.bfloat16, 128, 2048, 768, (128, 128), counts, 1e-2)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("tokens", [1, 11])
def test_grouped_path_runs_the_kernel(monkeypatch, tokens):
    """MoE.forward with block-scaled experts takes the grouped path at any number of tokens (at one
    token too: the one-token layer reads scales per row), both of its products through the kernel."""
    m, norm, x, seed = one_token_moe("cpu", torch.float32, HIDDEN, 8, 16, 3, 1)
    x = torch.randn(tokens, HIDDEN)
    ref_m = hold_fp8(m, (16, 16))
    monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda *a: True)
    monkeypatch.setattr(gemv, "applies", lambda x, *_: x.dim() == 2 and x.shape[0] == 1)  # as on a GPU
    launched = []
    monkeypatch.setattr(block_fp8_experts, "launch", lambda *a, f=block_fp8_experts.launch: launched.append(1) or f(*a))
    with torch.no_grad():
        ours = m(x, norm, residual=x)
    assert len(launched) == 2, f"seed={seed}: the kernel ran {len(launched)} times"
    torch.testing.assert_close(ours.double(), reference(ref_m, x, norm), rtol=1e-5, atol=1e-5,
                               msg=lambda msg: f"seed={seed}: {msg}")
