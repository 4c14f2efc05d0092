"""The fused q/k norm + RoPE + K/V store (flexsgl/kernels/rope_store.py).

The custom op (its PyTorch body, on the CPU) compiled with fullgraph writes the pool in place, with
no copy of the cache, and only at the given slots. The Triton kernel against a float64 evaluation
of the same formulas and against the PyTorch expressions it replaces: on the GPU compiled, on the
CPU through Triton's interpreter (small shapes: it runs a program at a time in Python).
"""

import random

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from flexsgl.kernels import rope_store
from flexsgl.model.layers import RotaryEmbedding


def random_case(t, hq, hkv, d, dtype, device, norm: bool, slots_total=4096, seed=None):
    seed = random.randrange(1 << 30) if seed is None else seed
    g = torch.Generator(device=device).manual_seed(seed)
    rand = lambda *s: torch.randn(*s, device=device, dtype=dtype, generator=g)  # noqa: E731
    rope = RotaryEmbedding(d, 40960, 1e6, None).to(device)
    pos = torch.randint(0, 40960, (t,), device=device, generator=g)
    slots = torch.randperm(slots_total, device=device, generator=g)[:t]
    qn, kn = ((0.5 + torch.rand(d, device=device, generator=g)).to(dtype) for _ in range(2)) if norm else (None, None)
    return dict(qkv=rand(t, (hq + 2 * hkv) * d), q_norm=qn, k_norm=kn, eps=1e-6, cos=rope.cos, sin=rope.sin,
                positions=pos, slots=slots, k_cache=rand(slots_total, hkv, d), v_cache=rand(slots_total, hkv, d),
                num_heads=hq), seed


def float64_reference(c):
    """q, k, v from the formulas (RMSNorm, rotate-half RoPE) in float64, no intermediate rounding."""
    hq, (hkv, d) = c["num_heads"], c["k_cache"].shape[1:]
    t = c["qkv"].shape[0]
    x = c["qkv"].double().view(t, hq + 2 * hkv, d)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    if c["q_norm"] is not None:
        rms = lambda y: y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + c["eps"])  # noqa: E731
        q, k = rms(q) * c["q_norm"].double(), rms(k) * c["k_norm"].double()
    pos = c["positions"]
    cos, sin = c["cos"].double()[pos][:, None], c["sin"].double()[pos][:, None]
    rot = lambda y: torch.cat((y[..., :d // 2] * cos - y[..., d // 2:] * sin,  # noqa: E731
                               y[..., d // 2:] * cos + y[..., :d // 2] * sin), -1)
    return rot(q), rot(k), v


def check_op(c, seed, rel_tol, op=None):
    before_k, before_v = c["k_cache"].clone(), c["v_cache"].clone()
    q = (op or torch.ops.flexsgl.rope_store)(**c)
    ref_q, ref_k, ref_v = float64_reference(c)
    torch_q, torch_k, torch_v = rope_store.norm_rope(c["qkv"], c["q_norm"], c["k_norm"], c["eps"], c["cos"], c["sin"],
                                                     c["positions"], c["num_heads"], c["k_cache"].shape[2])
    slots = c["slots"]
    for name, ours, ref, plain in (("q", q, ref_q, torch_q), ("k", c["k_cache"][slots], ref_k, torch_k),
                                   ("v", c["v_cache"][slots], ref_v, torch_v)):
        err = ((ours.double() - ref).norm() / ref.norm()).item()
        assert err < rel_tol, f"{name}: relative error {err:.2e} against float64 (seed={seed})"
        # The kernel rounds where the PyTorch expressions do: at most one rounding step apart.
        torch.testing.assert_close(ours, plain.to(ours.dtype), rtol=1e-2, atol=1e-2, msg=f"{name} (seed={seed})")
    untouched = torch.ones(c["k_cache"].shape[0], dtype=torch.bool, device=slots.device)
    untouched[slots] = False
    assert torch.equal(c["k_cache"][untouched], before_k[untouched]), f"K written outside its slots (seed={seed})"
    assert torch.equal(c["v_cache"][untouched], before_v[untouched]), f"V written outside its slots (seed={seed})"


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
def test_compiled_op_writes_the_pool_in_place(norm):
    c, seed = random_case(5, 4, 2, 32, torch.float32, "cpu", norm)
    eager = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in c.items()}
    check_op(eager, seed, 1e-5)

    def step(qkv, positions, slots, k_cache, v_cache):
        q = torch.ops.flexsgl.rope_store(qkv, c["q_norm"], c["k_norm"], c["eps"], c["cos"], c["sin"], positions,
                                         slots, k_cache, v_cache, c["num_heads"])
        return q * 2, k_cache[slots] + 1  # reads after the write see it

    k_ptr = c["k_cache"].data_ptr()
    (q2, k1), codes = run_and_get_code(torch.compile(step, fullgraph=True), c["qkv"], c["positions"], c["slots"],
                                       c["k_cache"], c["v_cache"])
    torch.testing.assert_close(q2, torch.ops.flexsgl.rope_store(**{**eager, "k_cache": eager["k_cache"].clone(),
                                                                     "v_cache": eager["v_cache"].clone()}) * 2)
    assert torch.equal(c["k_cache"], eager["k_cache"]) and torch.equal(c["v_cache"], eager["v_cache"])
    assert torch.equal(k1, eager["k_cache"][c["slots"]] + 1)
    assert c["k_cache"].data_ptr() == k_ptr
    # Every argument is a graph input; a functionalised mutation would hand the op a copy (a `buf`).
    calls = [line for code in codes for line in code.splitlines() if "= torch.ops.flexsgl.rope_store.default(" in line]
    assert len(calls) == 1 and "buf" not in calls[0].split("(", 1)[1], f"the op gets a copy of its input: {calls}"


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 128), (4, 2, 32)])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_float64_and_pytorch(t, hq, hkv, d, norm, dtype):
    c, seed = random_case(t, hq, hkv, d, dtype, "cuda", norm)
    assert rope_store.applies(c["qkv"].device, d)
    check_op(c, seed, 1e-2)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("t", [1, 7, 65])  # a program per head; from 64 tokens, per 8 heads (here a partial block)
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 32), (6, 1, 16)])
@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])  # bf16: see conftest
def test_interpreted_kernel_matches_float64_and_pytorch(t, hq, hkv, d, norm, dtype):
    c, seed = random_case(t, hq, hkv, d, dtype, "cpu", norm, slots_total=256)
    check_op(c, seed, 1e-5 if dtype == torch.float32 else 1e-2, op=rope_store.launch)
