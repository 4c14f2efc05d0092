"""The mixture-of-experts layer of DeepSeek and Qwen3-MoE: a softmax router, top-k routed experts and
shared experts (DeepSeek's; Qwen3-MoE has none).

The routed experts run as a grouped computation, without a Python loop over experts or tokens:
the (token, expert) pairs are sorted by expert, each expert's rows form one contiguous segment
whose bounds are found on the device (`searchsorted`, no host sync), and two grouped matrix
products (`torch.nn.functional.grouped_mm`: one GEMM per expert segment in one launch, the experts
with no rows reading nothing) compute gate/up and down for every pair; the outputs go back to
token order by the inverse permutation and are summed with their routing weights.

One token on a GPU (decode at batch 1) takes neither: its whole MoE layer, routing, every routed and
shared expert and the sum with the residual, is one launch (flexsgl/kernels/moe_layer.py), each
chosen expert's weights read once straight from the stacked tensors, where the unfused path takes
thirteen.

Where grouped_mm does not run (it takes bfloat16 on SM90+ GPUs and under torch.compile, and float32
only eagerly on the CPU; its strides must be multiples of 16 bytes), each (token, expert) pair
gathers its expert's weights and multiplies them batched: also one launch per projection and no
host sync, but it copies an expert's weights once per pair, so it is only fit for small models.

Expert weights are stacked, `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` (HF's layout in
transformers 5); checkpoints with one tensor per expert load into slices of them (their weight
loaders, flexsgl/model/weight_loaders.py StackedExperts). `Experts` may also hold a bias per expert
and projection, added to each pair's products, and a subclass may change the gated activation
(`glu`; GPT-OSS's clamped SwiGLU, flexsgl/model/gpt_oss.py).

Experts may hold their stacked weights in FP8 (float8_e4m3fn) with one float32 scale per row,
`gate_up_proj_scale [E, 2I, 1]` and `down_proj_scale [E, H, 1]`, or per block of a block-wise
checkpoint, `[E, 2I / bn, H / bk]` and `[E, H / bn, I / bk]` (`hold_fp8`; which experts do is
flexsgl/quant/apply.py's choice). With scales per row on an SM90 GPU the grouped products run as
`torch._scaled_grouped_mm`, the rows quantized per token as they come, as Fp8Linear's are
(flexsgl/quant/fp8_linear.py), and the one-token launch reads the FP8 bytes and scales each row's
sum; with block scales, at any number of tokens on a GPU, flexsgl/kernels/block_fp8_experts.py's
grouped kernel multiplies the activations as they are by the widened FP8 weights, block by block.
Elsewhere each pair's expert weights are dequantized as they are gathered.

Under tensor parallelism every rank holds every expert's slice of the intermediate dimension (and
of the shared experts'), routes every token alike with the replicated router, and computes a
partial sum of the layer's output; rank 0 adds the residual to its own, and one all-reduce adds
them (flexsgl/distributed/layers.py).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from flexsgl.distributed.allreduce import all_reduce
from flexsgl.distributed.group import first_rank
from flexsgl.kernels import block_fp8_experts, gemv, moe_layer
from flexsgl.model.layers import GatedMLP
from flexsgl.model.mla_config import MoEConfig
from flexsgl.model.weight_loaders import StackedExperts
from flexsgl.quant.fp8 import FP8, dequantize, quantize_tokens

# One expert's projection in a checkpoint with one tensor per expert: `...mlp.experts.<e>.<proj>.weight`
EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def expert_part(hf_name: str) -> tuple[str, tuple[int, int | None]] | None:
    """(stacked parameter, (expert, 0 gate / 1 up / None down)) that a per-expert checkpoint tensor
    fills, or None for any other name (a stacked checkpoint's `...mlp.experts.gate_up_proj` and
    `...down_proj` are the parameters' own names)."""
    expert = EXPERT.match(hf_name)
    if expert is None:
        return None
    prefix, e, proj = expert.groups()
    if proj == "down_proj":
        return f"{prefix}.down_proj", (int(e), None)
    return f"{prefix}.gate_up_proj", (int(e), int(proj == "up_proj"))


# torch.nn.functional.grouped_mm (torch 2.9+) wraps torch._grouped_mm (2.8+), which CUDA builds of 2.8 have;
# torch._scaled_grouped_mm (2.8+) is its FP8 form, with rowwise scales on SM90.
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)


class Experts(nn.Module):
    """Stacked routed experts: gate_up_proj `[E, 2I, H]` (gate rows, then up rows), down_proj `[E, H, I]`
    and, with `bias`, gate_up_proj_bias `[E, 2I]` and down_proj_bias `[E, H]`; held in FP8, also
    their scales per row or per `fp8_block`, gate_up_proj_scale and down_proj_scale (module docstring)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.gate_up_proj.weight_loader = StackedExperts(num_experts, halves=2)
        self.down_proj.weight_loader = StackedExperts(num_experts, halves=1)
        self.gate_up_proj_bias = self.down_proj_bias = None
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
            self.gate_up_proj_bias.weight_loader = StackedExperts(num_experts, halves=2)
            self.down_proj_bias.weight_loader = StackedExperts(num_experts, halves=1)
        self.gate_up_proj_scale = self.down_proj_scale = None
        self.fp8_block = None  # the scales' blocks (rows, columns), None for scales per row
        self.sm90 = False  # on an SM90+ GPU: set once by `place`, outside compiled code

    def hold_fp8(self, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                 down_scale: torch.Tensor, block: tuple[int, int] | None = None) -> None:
        """Hold the FP8 weights `gate_up` and `down` (of the stacked weights' shapes, on the meta device
        before allocation or on the model's) with their float32 scales, per row `[E, rows, 1]` or per
        `block` `[E, rows / bn, cols / bk]`, in place of the stacked weights, whose weight loaders they keep."""
        self.fp8_block = block
        for name, weight, scale in (("gate_up_proj", gate_up, gate_up_scale), ("down_proj", down, down_scale)):
            old = getattr(self, name)
            e, n, k = old.shape
            want = (e, n, 1) if block is None else (e, -(-n // block[0]), -(-k // block[1]))
            assert weight.dtype == FP8 and weight.shape == old.shape and tuple(scale.shape) == want
            new, new_scale = nn.Parameter(weight, requires_grad=False), nn.Parameter(scale, requires_grad=False)
            new.keep_dtype = new_scale.keep_dtype = True  # allocate() keeps FP8 and float32
            if hasattr(old, "weight_loader"):
                new.weight_loader = old.weight_loader
            setattr(self, name, new)
            setattr(self, f"{name}_scale", new_scale)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The gated activation of gate_up `[..., 2I]` (gate, then up): SiLU(gate) * up, `[..., I]`."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def place(self, device: torch.device) -> None:
        """Note what the device is (before the first step: compiled code reads a plain bool)."""
        self.sm90 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; experts, weights [T, k] -> sum over k of weight * expert(x), [T, H]."""
        if grouped_mm_runs(x, self.down_proj, self.sm90, self.fp8_block):
            return self._grouped(x, experts, weights)
        return self._gathered(x, experts, weights)

    def _grouped(self, x, experts, weights):
        t, k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # pairs sorted by expert; pair p is token p // k
        by_expert = flat[order]
        ends = torch.searchsorted(by_expert, torch.arange(self.down_proj.shape[0], device=x.device),
                                  right=True).to(torch.int32)  # where each expert's segment ends
        gate_up = grouped_product(x[order // k], self.gate_up_proj, self.gate_up_proj_scale, ends, self.fp8_block)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[by_expert]
        out = grouped_product(self.glu(gate_up), self.down_proj, self.down_proj_scale, ends, self.fp8_block)
        if self.down_proj_bias is not None:
            out = out + self.down_proj_bias[by_expert]
        out = torch.empty_like(out).index_copy_(0, order, out).view(t, k, -1)  # back to (token, slot) order
        return (out * weights.to(out.dtype)[..., None]).sum(1)

    def _gathered(self, x, experts, weights):
        gate_up_w = gathered(self.gate_up_proj, self.gate_up_proj_scale, experts, x.dtype, self.fp8_block)
        gate_up = torch.einsum("th,tkih->tki", x, gate_up_w)
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + self.gate_up_proj_bias[experts]
        down_w = gathered(self.down_proj, self.down_proj_scale, experts, x.dtype, self.fp8_block)
        out = torch.einsum("tki,tkhi->tkh", self.glu(gate_up), down_w)
        if self.down_proj_bias is not None:
            out = out + self.down_proj_bias[experts]
        return (out * weights.to(out.dtype)[..., None]).sum(1)


def grouped_product(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, ends: torch.Tensor,
                    block: tuple[int, int] | None = None) -> torch.Tensor:
    """a @ weight[e].T for the rows of each expert e's segment (`ends`: where each ends); FP8
    weights with their `scale` per row multiply with a's rows quantized per token, those with a
    scale per `block` with a as it is."""
    if scale is None:
        return GROUPED_MM(a, weight.transpose(1, 2), offs=ends)
    if block is not None:
        return block_fp8_experts.block_fp8_experts(a, weight, scale, ends)  # the custom op
    aq, a_scale = quantize_tokens(a)
    return SCALED_GROUPED_MM(aq, weight.transpose(1, 2), a_scale.view(-1), scale.view(scale.shape[0], -1), offs=ends,
                             out_dtype=a.dtype)


def gathered(weight: torch.Tensor, scale: torch.Tensor | None, experts: torch.Tensor, dtype: torch.dtype,
             block: tuple[int, int] | None = None) -> torch.Tensor:
    """The stacked `weight` of each of `experts`, in `dtype` (FP8 weights dequantized by their `scale`,
    per row or per `block`)."""
    if scale is None:
        return weight[experts]
    if block is not None:
        return dequantize(weight[experts], scale[experts], "block", block).to(dtype)
    return (weight[experts].float() * scale[experts]).to(dtype)


def grouped_mm_runs(x: torch.Tensor, weight: torch.Tensor, sm90: bool, block: tuple[int, int] | None = None) -> bool:
    """Whether torch's grouped_mm (for FP8 weights, its scaled form, or with `block` scales
    flexsgl's kernel) takes these operands here (see the module docstring)."""
    if weight.dtype == FP8 and block is not None:
        return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    if weight.dtype == FP8:  # operands of one byte an element: every dimension a multiple of 16
        return (SCALED_GROUPED_MM is not None and x.is_cuda and x.dtype == torch.bfloat16 and sm90
                and all(n % 16 == 0 for n in weight.shape[1:]))
    if GROUPED_MM is None or any(n * x.element_size() % 16 for n in weight.shape[1:]):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and sm90
    if x.device.type == "cpu":
        return x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and not torch.compiler.is_compiling())
    return False


class MoE(nn.Module):
    """Router (`gate`), routed `experts` and `shared_experts`, named as in HF checkpoints."""

    def __init__(self, hidden: int, cfg: MoEConfig, parallel: bool = False):
        """cfg: this rank's (its slice of the intermediate dimension); parallel: tensor-parallel ranks
        sum their partial outputs."""
        super().__init__()
        self.cfg, self.parallel = cfg, parallel
        self.gate = nn.Linear(hidden, cfg.n_routed_experts, bias=False)
        self.experts = Experts(cfg.n_routed_experts, hidden, cfg.intermediate_size)
        self.shared_experts = (GatedMLP(hidden, cfg.intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        # the one-token launch's counters (flexsgl/kernels/moe_layer.py), zero between launches
        slots = cfg.top_k + cfg.n_shared_experts
        self.register_buffer("counters", torch.zeros(moe_layer.counters_size(hidden, slots), dtype=torch.int32),
                             persistent=False)

    def place(self, device: torch.device) -> None:
        """Before the first step: note what the device is, and zero the counters (a model built on the
        meta device and then allocated holds garbage there)."""
        self.experts.place(device)
        self.counters = torch.zeros_like(self.counters, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k experts of each token and their weights (float32), as DeepSeek-V2 and Qwen3-MoE route."""
        c = self.cfg
        scores = F.linear(x.float(), self.gate.weight.float()).softmax(dim=-1)
        if c.topk_method == "group_limited_greedy":  # only experts of the topk_group best groups
            groups = scores.view(-1, c.n_group, c.n_routed_experts // c.n_group)
            best = groups.amax(-1).topk(c.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            scores = groups.masked_fill(~keep[..., None], 0.0).view_as(scores)
        weights, experts = torch.topk(scores, k=c.top_k, dim=-1, sorted=False)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        else:
            weights = weights * c.routed_scaling_factor
        return experts, weights

    def forward(self, x: torch.Tensor, norm, residual: torch.Tensor) -> torch.Tensor:
        """residual + moe(norm(x))."""
        if not self.parallel:
            return self.partial(x, norm, residual)
        return all_reduce(self.partial(x, norm, residual if first_rank() else None))

    def partial(self, x: torch.Tensor, norm, residual: torch.Tensor | None) -> torch.Tensor:
        """residual + this rank's part of moe(norm(x)) (all of it with one rank); residual None: none."""
        if gemv.applies(x, self.experts.down_proj) and self.experts.fp8_block is None:
            return self.one_token(x, norm, torch.zeros_like(x) if residual is None else residual)
        h = norm(x)
        experts, weights = self.route(h)
        out = self.experts(h, experts, weights)
        out = out if residual is None else out + residual
        if self.shared_experts is None:
            return out
        return gemv.silu_linear(gemv.linear(h, self.shared_experts.gate_up_proj, None), self.shared_experts.down_proj,
                                residual=out)

    def one_token(self, x: torch.Tensor, norm, residual: torch.Tensor) -> torch.Tensor:
        """forward for one token on a GPU, in one launch (flexsgl/kernels/moe_layer.py); greedy routing
        runs inside it, group-limited routing before it."""
        c, shared = self.cfg, self.shared_experts
        router, experts, weights = self.gate.weight, None, None
        if c.topk_method != "greedy":
            router = None
            experts, weights = self.route(norm(x))
        return torch.ops.flexsgl.moe_layer(
            x, residual, norm.weight, norm.eps, self.experts.gate_up_proj, self.experts.down_proj,
            shared.gate_up_proj.weight if shared is not None else None,
            shared.down_proj.weight if shared is not None else None, self.counters, router, c.top_k,
            c.norm_topk_prob, c.routed_scaling_factor, experts, weights, self.experts.gate_up_proj_scale,
            self.experts.down_proj_scale)
