"""DeepSeek MoE (routing, grouped and gathered expert products, shared experts) against a per-token
float64 loop written from DeepSeek-V2's definition."""

import random

import pytest
import torch

import flexsgl.model.moe as moe_module
from flexsgl.kernels import gemv, moe_route
from flexsgl.model.layers import RMSNorm
from flexsgl.model.mla_config import MoEConfig
from flexsgl.model.moe import MoE

HIDDEN = 32


def reference(m: MoE, x: torch.Tensor, norm: RMSNorm, with_scale: bool = False):
    """float64 from the normed input on (in its own dtype, so routing sees what the model sees).
    with_scale: also, per output, the sum of the magnitudes of everything it adds up (the residual,
    and each product term of each down projection, |W| @ |a|), the scale of the rounding error a
    half-precision run makes."""
    c = m.cfg
    h = norm(x).double()
    out, scale = [], []
    for t in range(h.shape[0]):
        scores = (m.gate.weight.double() @ h[t]).softmax(-1)
        allowed = list(range(c.n_routed_experts))
        if c.topk_method == "group_limited_greedy":
            size = c.n_routed_experts // c.n_group
            best = sorted(range(c.n_group), key=lambda g: -scores[g * size:(g + 1) * size].max().item())
            allowed = [e for g in best[:c.topk_group] for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: -scores[e].item())[:c.top_k]
        w = scores[chosen]
        w = w / w.sum() if c.norm_topk_prob else w * c.routed_scaling_factor
        y, size = x[t].double(), x[t].double().abs()
        mlps = [(we, m.experts.gate_up_proj[e], m.experts.down_proj[e]) for e, we in zip(chosen, w)]
        if m.shared_experts is not None:
            mlps.append((1.0, m.shared_experts.gate_up_proj.weight, m.shared_experts.down_proj.weight))
        for we, gate_up, down in mlps:
            gate, up = (gate_up.double() @ h[t]).chunk(2)
            a = torch.nn.functional.silu(gate) * up
            y = y + we * (down.double() @ a)
            size = size + abs(we) * (down.double().abs() @ a.abs())
        out.append(y)
        scale.append(size)
    return (torch.stack(out), torch.stack(scale)) if with_scale else torch.stack(out)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("method,norm_topk,shared", [("greedy", False, 2), ("group_limited_greedy", False, 1),
                                                     ("greedy", True, 0)])
def test_moe_matches_a_per_token_loop(monkeypatch, grouped, method, norm_topk, shared):
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    cfg = MoEConfig(n_routed_experts=8, n_shared_experts=shared, top_k=3, intermediate_size=16,
                    first_k_dense_replace=0, routed_scaling_factor=1.7, topk_method=method, n_group=4, topk_group=2,
                    norm_topk_prob=norm_topk)
    m = MoE(HIDDEN, cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    norm = RMSNorm(HIDDEN, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    if not grouped:
        monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda x, w, sm90: False)
    x = torch.randn(11, HIDDEN)  # more tokens than experts: some experts take several, some none
    with torch.no_grad():
        ours = m(x, norm, residual=x)
    torch.testing.assert_close(ours.double(), reference(m, x, norm), rtol=1e-5, atol=1e-5,
                               msg=lambda msg: f"seed={seed}: {msg}")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_grouped_moe_in_bf16_on_gpu(tokens):
    """The routed experts on the GPU (SM90+, bfloat16: grouped_mm, and at one token the matrix-vector
    kernel), compiled as decode and prefill steps are, against the float64 loop: bf16 rounding of
    the activations and weights only."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("grouped_mm runs on SM90+ GPUs")
    check_bf16_moe(tokens, torch.device("cuda"), lambda m: torch.compile(m, dynamic=False))


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("shared", [0, 2])
def test_one_token_through_the_decode_kernels(monkeypatch, shared):
    """One token's MoE layer as a GPU runs it at decode batch 1 (the fused routing kernel, expert_gemv:
    a launch for gate/up, one for down with the SiLU gate and the routing weights; the shared experts
    through the matrix-vector kernel), here through Triton's interpreter in float32."""
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    cfg = MoEConfig(n_routed_experts=8, n_shared_experts=shared, top_k=3, intermediate_size=16, first_k_dense_replace=0,
                    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=True)
    m = MoE(HIDDEN, cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    norm = RMSNorm(HIDDEN, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    one_row = lambda x, *_: x.dim() == 2 and x.shape[0] == 1  # noqa: E731
    monkeypatch.setattr(moe_route, "applies", one_row)
    monkeypatch.setattr(gemv, "applies", one_row)
    launched = []
    monkeypatch.setattr(moe_route, "launch", lambda *a, f=moe_route.launch: launched.append(1) or f(*a))
    x = torch.randn(1, HIDDEN)
    with torch.no_grad():
        ours = m(x, norm, residual=x)
    assert launched, "the fused routing kernel did not run"
    torch.testing.assert_close(ours.double(), reference(m, x, norm), rtol=1e-5, atol=1e-5,
                               msg=lambda msg: f"seed={seed}: {msg}")


def check_fused_routing(device, dtype, experts, hidden, top_k, norm_topk):
    """moe_route on one token: its experts and weights against float64 routing of the input normed in
    float64 (the router's product reads it unrounded), launched twice on one count, which each launch
    must leave at zero; draws are repeated until the k-th choice is decisive."""
    seed = random.randrange(1 << 30)
    g = torch.Generator(device=device).manual_seed(seed)
    norm = (0.5 + torch.rand(hidden, device=device, generator=g)).to(dtype)
    gate = (0.3 * torch.randn(experts, hidden, device=device, generator=g)).to(dtype)
    for _ in range(50):
        x = torch.randn(1, hidden, device=device, generator=g).to(dtype)
        x64 = x.double()
        h64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
        scores = (h64 @ gate.double().T).softmax(-1)
        top = scores.sort(-1, descending=True).values
        if ((top[:, top_k - 1] - top[:, top_k]) > 1e-3 * top[:, 0]).all():
            break
    else:
        pytest.fail(f"seed={seed}: no draw with decisive routing")
    count = torch.zeros(1, dtype=torch.int32, device=device)
    first = moe_route.launch(x, norm, 1e-6, gate, top_k, norm_topk, 1.7, count)
    assert count.item() == 0, f"seed={seed}: the count was left at {count.item()}"
    ours_experts, ours_weights = moe_route.launch(x, norm, 1e-6, gate, top_k, norm_topk, 1.7, count)
    assert count.item() == 0, f"seed={seed}: the count was left at {count.item()}"
    assert torch.equal(first[0], ours_experts), f"seed={seed}: a second launch routed differently"
    assert ours_experts.dtype == torch.int32 and ours_weights.dtype == torch.float32
    weights, chosen = scores.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True) if norm_topk else weights * 1.7
    order = ours_experts.long().argsort(-1)
    assert torch.equal(ours_experts.long().gather(-1, order), chosen.sort(-1).values), f"seed={seed}: experts"
    ref_weights = weights.gather(-1, chosen.argsort(-1))
    torch.testing.assert_close(ours_weights.double().gather(-1, order), ref_weights, rtol=1e-5, atol=1e-6,
                               msg=lambda msg: f"seed={seed}: routing weights: {msg}")


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("experts,hidden,top_k,norm_topk", [(8, 40, 3, True), (12, 300, 4, False)])
def test_fused_routing_matches_float64(experts, hidden, top_k, norm_topk):
    """The routing kernel through Triton's interpreter in float32, with expert counts a power of two
    and not, and a hidden size its tiles do not divide."""
    check_fused_routing("cpu", torch.float32, experts, hidden, top_k, norm_topk)


@pytest.mark.gpu
@pytest.mark.parametrize("norm_topk", [True, False])
def test_fused_routing_in_bf16_on_gpu(norm_topk):
    """DeepSeek-V2-Lite's router: 64 experts, hidden 2048, top 6, bfloat16 input and weights."""
    check_fused_routing("cuda", torch.bfloat16, 64, 2048, 6, norm_topk)


@pytest.mark.parametrize("tokens", [1, 300])
def test_grouped_moe_in_bf16_on_cpu(tokens):
    """The same on the CPU, where grouped_mm runs eagerly in bfloat16."""
    check_bf16_moe(tokens, torch.device("cpu"), lambda m: m)


def check_bf16_moe(tokens: int, device: torch.device, wrap):
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    cfg = MoEConfig(n_routed_experts=64, n_shared_experts=2, top_k=6, intermediate_size=128, first_k_dense_replace=0,
                    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=True)
    m, norm = MoE(256, cfg).to(device, torch.bfloat16), RMSNorm(256, 1e-6).to(device, torch.bfloat16)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m.experts.place(device)
    assert moe_module.grouped_mm_runs(torch.empty(1, 256, device=device, dtype=torch.bfloat16), m.experts.down_proj,
                                      m.experts.sm90)
    # A token whose k-th and (k+1)-th router logits are within bf16 rounding of each other may pick
    # another expert in bf16 than in float64 (one such token among 300 was seen on an H100): only
    # tokens whose choice is decisive are compared; a few tokens are drawn until all are, and of
    # many, most must be (~13% of gaps are under the margin here).
    for _ in range(50):
        x = torch.randn(tokens, 256, device=device, dtype=torch.bfloat16)
        logits = (m.gate.weight.double() @ norm(x).double().T).T.sort(dim=-1, descending=True).values
        decisive = (logits[:, cfg.top_k - 1] - logits[:, cfg.top_k]) > 0.02
        if decisive.all() or (tokens >= 100 and decisive.float().mean() > 0.75):
            break
    else:
        pytest.fail(f"seed={seed}: no draw with decisive routing")
    with torch.no_grad():
        ours = wrap(m)(x, norm, residual=x)
        ref, scale = reference(m, x, norm, with_scale=True)  # the same bf16 routing input; float64 from there
    assert_within_bf16_rounding(ours[decisive], ref[decisive], scale[decisive], seed)


def assert_within_bf16_rounding(ours, ref, scale, seed):
    """Each output is a sum of terms (the residual, and every product of a down projection's weight
    and activation), rounded to bf16 on their way (relative 2^-9 each, the activations after
    products whose inputs were rounded too). An output that cancels to near zero keeps the absolute
    error of its terms, so the bound is relative to their magnitudes (2^-8 of their sum) plus 1%
    of the output itself. A wrong expert, weight or row moves an output by about a whole term."""
    err = (ours.double() - ref).abs()
    bound = 2.0 ** -8 * scale + 1e-2 * ref.abs()
    worst = (err / bound).argmax()
    assert (err <= bound).all(), (f"seed={seed}: {int((err > bound).sum())} of {err.numel()} outputs off by "
                                  f"more than bf16 rounding, worst {err.flatten()[worst]:.4f} against a bound "
                                  f"of {bound.flatten()[worst]:.4f}")
