"""DeepSeek MoE (routing, grouped and gathered expert products, shared experts) against a per-token
float64 loop written from DeepSeek-V2's definition; routed experts in FP8 against the same loop on
the weights they stand for."""

import copy
import random

import pytest
import torch

import flexsgl.model.moe as moe_module
from flexsgl.kernels import gemv, moe_layer
from flexsgl.model.layers import RMSNorm
from flexsgl.model.mla_config import MoEConfig
from flexsgl.model.moe import MoE
from tests.fp8_checkpoints import quantize

HIDDEN = 32


def hold_fp8(m: MoE, block: tuple[int, int] | None = None) -> MoE:
    """Quantize m's routed experts to FP8 per row, or per `block` (tests/fp8_checkpoints.py, not
    flexsgl.quant) and have m hold them; returns a copy of m whose experts hold, unquantized, the
    float32 weights the FP8 ones stand for (the reference's)."""
    ref = copy.deepcopy(m)
    ref.experts.float()
    held = []
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(m.experts, name).data
        q, scale, deq = zip(*(quantize(w[e].float(), "block" if block else "channel", block)
                              for e in range(w.shape[0])))
        getattr(ref.experts, name).data.copy_(torch.stack(deq))
        held += [torch.stack(q).to(w.device), torch.stack(scale).to(w.device)]
    m.experts.hold_fp8(*held, block)
    return ref


def fp8_rows(v: torch.Tensor) -> torch.Tensor:
    """v rounded to FP8 with one scale (absmax / 448), as the FP8 grouped products quantize each row."""
    scale = v.abs().max() / 448
    return (v / scale).float().to(torch.float8_e4m3fn).double() * scale


def reference(m: MoE, x: torch.Tensor, norm: RMSNorm, with_scale: bool = False, fp8_inputs: bool = False):
    """float64 from the normed input on (in its own dtype, so routing sees what the model sees).
    with_scale: also, per output, the sum of the magnitudes of everything it adds up (the residual,
    and each product term of each down projection, |W| @ |a|), the scale of the rounding error a
    half-precision run makes. fp8_inputs: the routed experts' inputs rounded to FP8 per row."""
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
        rounded = fp8_rows if fp8_inputs else (lambda v: v)
        mlps = [(we, m.experts.gate_up_proj[e], m.experts.down_proj[e], rounded) for e, we in zip(chosen, w)]
        if m.shared_experts is not None:
            mlps.append((1.0, m.shared_experts.gate_up_proj.weight, m.shared_experts.down_proj.weight, lambda v: v))
        for we, gate_up, down, inputs in mlps:
            gate, up = (gate_up.double() @ inputs(h[t])).chunk(2)
            a = inputs(torch.nn.functional.silu(gate) * up)
            y = y + we * (down.double() @ a)
            size = size + abs(we) * (down.double().abs() @ a.abs())
        out.append(y)
        scale.append(size)
    return (torch.stack(out), torch.stack(scale)) if with_scale else torch.stack(out)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("method,norm_topk,shared,fp8", [
    ("greedy", False, 2, False), ("group_limited_greedy", False, 1, False), ("greedy", True, 0, False),
    ("greedy", False, 2, "rows"), ("greedy", True, 0, "rows"), ("greedy", False, 1, "blocks")])
def test_moe_matches_a_per_token_loop(monkeypatch, grouped, method, norm_topk, shared, fp8):
    """fp8: the routed experts held in FP8 with a scale per row or per 16 x 16 block (on the CPU each
    pair's weights are dequantized as gathered) against the loop on the float32 weights they stand for."""
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
    ref_m = hold_fp8(m, (16, 16) if fp8 == "blocks" else None) if fp8 else m
    if not grouped:
        monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda *a: False)
    x = torch.randn(11, HIDDEN)  # more tokens than experts: some experts take several, some none
    with torch.no_grad():
        ours = m(x, norm, residual=x)
    torch.testing.assert_close(ours.double(), reference(ref_m, x, norm), rtol=1e-5, atol=1e-5,
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


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype):
    """torch._scaled_grouped_mm as its documentation defines it, for the CPU (which lacks it): each
    group's rows of a times its matrix of b, each scaled by its scales; the arguments first pass
    through the op itself on the meta device, which checks their dtypes, shapes and strides."""
    meta = [t.to("meta") for t in (a, b, scale_a, scale_b, offs)]
    assert torch._scaled_grouped_mm(*meta[:4], offs=meta[4], out_dtype=out_dtype).shape == (a.shape[0], b.shape[2])
    out, start = torch.empty(a.shape[0], b.shape[2], dtype=torch.float64), 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].double() * scale_a[start:end, None]) @ (b[g].double() * scale_b[g][None, :])
        start = end
    return out.to(out_dtype)


def test_fp8_grouped_products_take_torchs_arguments(monkeypatch):
    """The FP8 grouped path on the CPU, its torch._scaled_grouped_mm emulated (after torch's own checks
    of the arguments): 300 tokens match the loop with the routed experts' inputs rounded to FP8."""
    monkeypatch.setattr(moe_module, "SCALED_GROUPED_MM", emulated_scaled_grouped_mm)
    monkeypatch.setattr(moe_module, "grouped_mm_runs", lambda *a: True)
    check_bf16_moe(300, torch.device("cpu"), lambda m: m, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_grouped_moe_on_fp8_experts_on_gpu(tokens):
    """Routed experts in FP8 on an SM90 GPU (torch._scaled_grouped_mm, and at one token the one-launch
    layer), compiled, against the float64 loop on the weights they stand for with the routed
    experts' inputs rounded to FP8 per row as the grouped products round them (at one token the
    layer reads its input unrounded: FP8 rounding of an input is 2^-4 of it, inside the bound)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch._scaled_grouped_mm runs on SM90 GPUs")
    check_bf16_moe(tokens, torch.device("cuda"), lambda m: torch.compile(m, dynamic=False), fp8=True)


def one_token_moe(device, dtype, hidden, experts, inter, top_k, shared, method="greedy", norm_topk=True):
    """A MoE layer, its norm and one token whose top_k-th expert is decisively ahead of the next
    (draws repeated until it is), for the one-launch layer; and the seed."""
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    cfg = MoEConfig(n_routed_experts=experts, n_shared_experts=shared, top_k=top_k, intermediate_size=inter,
                    first_k_dense_replace=0, routed_scaling_factor=1.7, topk_method=method, n_group=4, topk_group=2,
                    norm_topk_prob=norm_topk)
    m, norm = MoE(hidden, cfg), RMSNorm(hidden, 1e-6)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=hidden ** -0.5)
    torch.nn.init.normal_(m.gate.weight, std=2 * hidden ** -0.5)  # logits of unit size: no routing weight vanishes
    norm.weight.data.uniform_(0.5, 1.5)
    m, norm = m.to(device, dtype), norm.to(device, dtype)
    m.place(torch.device(device))
    for _ in range(50):
        x = torch.randn(1, hidden, device=device).to(dtype)
        top = router_scores(m, norm, x).sort(-1, descending=True).values
        if ((top[:, top_k - 1] - top[:, top_k]) > 1e-3 * top[:, 0]).all():
            return m, norm, x, seed
    pytest.fail(f"seed={seed}: no draw with decisive routing")


def router_scores(m: MoE, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """float64 softmax of the router's logits of x normed in float64 (the kernel does not round the
    normed input to x's dtype before the router's product)."""
    x64 = x.double()
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    return (h @ m.gate.weight.double().T).softmax(-1)


def check_one_token_layer(device, dtype, hidden, experts, inter, top_k, shared, norm_topk, tol, fp8=False):
    """flexsgl/kernels/moe_layer.py against the float64 loop: the routing it chose (experts and
    weights), and y = residual + the layer, launched twice on one set of counters, which each launch
    must leave at zero; then with the routing given instead of computed. fp8: the routed experts in
    FP8 with their scales per row, the loop on the weights they stand for."""
    m, norm, x, seed = one_token_moe(device, dtype, hidden, experts, inter, top_k, shared, norm_topk=norm_topk)
    ref_m = hold_fp8(m) if fp8 else m
    residual = torch.randn_like(x)
    sh = m.shared_experts
    shared = (sh.gate_up_proj.weight.data, sh.down_proj.weight.data) if sh is not None else (None, None)
    weights = (m.experts.gate_up_proj.data, m.experts.down_proj.data, *shared)
    scales = dict(gate_up_scale=m.experts.gate_up_proj_scale, down_scale=m.experts.down_proj_scale)
    c = m.cfg
    ref = reference(ref_m, x, norm) - x.double() + residual.double()
    ref_w, ref_e = router_scores(m, norm, x)[0].topk(top_k)
    ref_w = ref_w / ref_w.sum() if norm_topk else ref_w * c.routed_scaling_factor
    runs = []
    for _ in range(2):
        runs.append(moe_layer.launch(x, residual, norm.weight, 1e-6, *weights, m.counters, m.gate.weight, top_k,
                                     norm_topk, c.routed_scaling_factor, **scales))
        assert not m.counters.any(), f"seed={seed}: counters left at {m.counters.tolist()}"
    (y, chosen, chosen_w), again = runs
    assert chosen.dtype == torch.int32 and chosen_w.dtype == torch.float32
    assert torch.equal(y, again[0]), f"seed={seed}: a second launch gave another output"
    order = chosen.long().argsort()
    assert torch.equal(chosen.long()[order], ref_e.sort().values), f"seed={seed}: experts {chosen.tolist()}"
    torch.testing.assert_close(chosen_w.double()[order], ref_w[ref_e.argsort()], rtol=1e-5, atol=1e-6,
                               msg=lambda msg: f"seed={seed}: routing weights: {msg}")
    given = moe_layer.launch(x, residual, norm.weight, 1e-6, *weights, m.counters, experts=ref_e.to(torch.int32),
                             weights=ref_w.float(), **scales)[0]
    assert not m.counters.any(), f"seed={seed}: counters left at {m.counters.tolist()}"
    for name, out in (("routed inside", y), ("routing given", given)):
        err = ((out.double() - ref).norm() / (ref - residual.double()).norm()).item()
        assert err < tol, f"seed={seed}, {name}: relative error {err:.2e}"


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("shared,norm_topk", [(0, True), (1, False), (2, True)])
@pytest.mark.parametrize("hidden,inter", [(64, 16), (40, 24)], ids=["even", "odd-tiles"])
def test_interpreted_one_token_layer_matches_float64(shared, norm_topk, hidden, inter):
    """Through Triton's interpreter in float32, with no, one and two shared experts, and sizes the
    tiles divide and do not."""
    check_one_token_layer("cpu", torch.float32, hidden, 8, inter, 3, shared, norm_topk, 1e-5)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("shared", [0, 2])
def test_interpreted_one_token_layer_on_fp8_experts(shared):
    """Routed experts in FP8 (the shared ones in the model's dtype): the kernel reads their FP8 bytes
    and scales each row's sum."""
    check_one_token_layer("cpu", torch.float32, 40, 8, 24, 3, shared, True, 1e-5, fp8=True)


@pytest.mark.usefixtures("triton_interpreter")
def test_interpreted_routing_over_uneven_experts_and_a_long_hidden():
    """12 experts (not a power of two), top 4, and a hidden size past one router block (2,048) that
    no tile divides."""
    check_one_token_layer("cpu", torch.float32, 2100, 12, 8, 4, 1, False, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("norm_topk", [True, False])
def test_one_token_layer_in_bf16_on_gpu(norm_topk):
    """DeepSeek-V2-Lite's MoE layer: 64 experts of [2816, 2048] and [2048, 1408], top 6, two shared
    experts, bfloat16."""
    check_one_token_layer("cuda", torch.bfloat16, 2048, 64, 1408, 6, 2, norm_topk, 1e-2)


@pytest.mark.gpu
def test_one_token_layer_on_fp8_experts_on_gpu():
    """The same layer with its routed experts in FP8 and the shared ones in bfloat16."""
    check_one_token_layer("cuda", torch.bfloat16, 2048, 64, 1408, 6, 2, True, 1e-2, fp8=True)


@pytest.mark.usefixtures("triton_interpreter")
@pytest.mark.parametrize("method,fp8", [("greedy", False), ("group_limited_greedy", False), ("greedy", True)])
def test_one_token_through_the_module(monkeypatch, method, fp8):
    """MoE.forward at one token takes the one-launch layer, with greedy routing inside it and
    group-limited routing computed before it, and with FP8 experts their scales, and matches the
    float64 loop."""
    m, norm, x, seed = one_token_moe("cpu", torch.float32, 32, 8, 16, 3, 2, method=method)
    ref_m = hold_fp8(m) if fp8 else m
    monkeypatch.setattr(gemv, "applies", lambda x, *_: x.dim() == 2 and x.shape[0] == 1)
    launched = []
    monkeypatch.setattr(moe_layer, "launch", lambda *a, f=moe_layer.launch: launched.append(a) or f(*a))
    with torch.no_grad():
        ours = m(x, norm, residual=x)
    assert len(launched) == 1, "the one-token layer did not run"
    gate_up_scale = launched[0][15]  # launch's argument after experts and weights
    assert (gate_up_scale is not None) == fp8 and (not fp8 or gate_up_scale is m.experts.gate_up_proj_scale)
    torch.testing.assert_close(ours.double(), reference(ref_m, x, norm), rtol=1e-5, atol=1e-5,
                               msg=lambda msg: f"seed={seed}: {msg}")


@pytest.mark.parametrize("tokens", [1, 300])
def test_grouped_moe_in_bf16_on_cpu(tokens):
    """The same on the CPU, where grouped_mm runs eagerly in bfloat16."""
    check_bf16_moe(tokens, torch.device("cpu"), lambda m: m)


def check_bf16_moe(tokens: int, device: torch.device, wrap, fp8: bool = False):
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    cfg = MoEConfig(n_routed_experts=64, n_shared_experts=2, top_k=6, intermediate_size=128, first_k_dense_replace=0,
                    routed_scaling_factor=1.0, topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=True)
    m, norm = MoE(256, cfg).to(device, torch.bfloat16), RMSNorm(256, 1e-6).to(device, torch.bfloat16)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    m.experts.place(device)
    ref_m = hold_fp8(m) if fp8 else m
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
        # the same bf16 routing input; float64 from there
        ref, scale = reference(ref_m, x, norm, with_scale=True, fp8_inputs=fp8 and tokens > 1)
    assert_within_bf16_rounding(ours[decisive], ref[decisive], scale[decisive], seed, 2.0 ** -5 if fp8 else 2.0 ** -8)


def assert_within_bf16_rounding(ours, ref, scale, seed, rel=2.0 ** -8):
    """Each output is a sum of terms (the residual, and every product of a down projection's weight
    and activation), rounded to bf16 on their way (relative 2^-9 each, the activations after
    products whose inputs were rounded too). An output that cancels to near zero keeps the absolute
    error of its terms, so the bound is relative to their magnitudes (2^-8 of their sum) plus 1%
    of the output itself. A wrong expert, weight or row moves an output by about a whole term. With
    FP8 experts (`rel` 2^-5) an activation rounded in bf16 may round to a neighbouring FP8 value, an
    error of 2^-4 of that element's term."""
    err = (ours.double() - ref).abs()
    bound = rel * scale + 1e-2 * ref.abs()
    worst = (err / bound).argmax()
    assert (err <= bound).all(), (f"seed={seed}: {int((err > bound).sum())} of {err.numel()} outputs off by "
                                  f"more than bf16 rounding, worst {err.flatten()[worst]:.4f} against a bound "
                                  f"of {bound.flatten()[worst]:.4f}")
