"""FlexAttention over the paged KV pool: the default backend, FlexAttentionBackend.

Its step metadata (the page positions, the BlockMask or dense mask, the query layout) is
FlexMetaBuilder's (flex_meta.py); this class is the attention call over it. Compiled on CUDA,
decode runs through flex_ops.py's opaque op (a kernel per batch size, outside the compiled decoder
layer) and prefill runs flex_attention inside the layer, with the options flex_options.py picks for
the pages or for packed rows; compiled on the CPU, flex_attention runs for both. Not compiled,
SDPA applies the step's dense mask, and where a variant's score_mod or a sink changes the scores
they are written out (`_scores_written_out`).

An FP8 pool (kv_cache_dtype fp8_e4m3) is read as it is where FlexAttention's Triton kernels run
(compiled, on CUDA: they cast K and V to the query's dtype as they load them; the scales are the
attention layer's, model/decoder.py); elsewhere, and for packed rows, the step's K/V are cast first.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, flex_attention
from torch.torch_version import TorchVersion

from flexsgl.attention.base import AttentionBackend, ForwardBatch
from flexsgl.attention.flash_mods import flash_refusal
from flexsgl.attention.flex_meta import FlexMeta, FlexMetaBuilder
from flexsgl.attention.flex_ops import MAX_KERNEL_ELEMENTS, flex_decode, with_sink
from flexsgl.attention.flex_options import FLASH, packed_prefill_options, prefill_options, variant_prefill_options
from flexsgl.cache.pool import KVPool

# flex_attention's log-sum-exp: torch before 2.13 multiplies every backend's by ln 2 (Triton's kernels
# keep it in base 2), FLASH's too, which flash-attn-4 gives in base e already; this undoes that.
FLASH_LSE_SCALE = 1.0 if TorchVersion(torch.__version__) >= "2.13" else 1 / math.log(2)


class FlexAttentionBackend(FlexMetaBuilder, AttentionBackend):
    name = "flex"
    graphable = True
    compiles_per_shape = True  # its kernels are compiled per batch size and page-table width

    def __init__(self, pool: KVPool, num_heads: int | None = None, compiled: bool = False, variants=None):
        """As FlexMetaBuilder's; on CUDA, also the kernel options of each compiled prefill regime."""
        super().__init__(pool, num_heads, compiled, variants)
        cuda = pool.device.type == "cuda"
        self.kernel_options = self.cuda_kernel_options() if cuda else None
        self.packed_kernel_options = self.packed_cuda_kernel_options() if cuda and self.packs_prefill else None
        # Each variant's prefill options, over pages and over packed rows: FLASH where it runs and
        # compiles the mods correctly, else the Triton kernel (flex_options.variant_prefill_options)
        self.variant_options: dict[int, tuple[dict, dict]] = {}
        if cuda and self.variants:
            dim, dtype = self.kv_shape()[1], self.pool.k[0].dtype
            for bound in self.variants:
                refused = flash_refusal(bound.variant, dim, self.pool.page_size, dtype)
                self.variant_options[bound.id] = tuple(
                    variant_prefill_options(dim, self.pool.page_size, dtype, packed, refused) for packed in (False, True))
            self.flash_variants = any(FLASH in both for both in self.variant_options.values())

    def cuda_kernel_options(self) -> dict:
        """Options of flex's main kernel on CUDA (compiled prefill; the CPU takes none)."""
        return prefill_options(self.kv_shape()[1], self.pool.page_size, self.pool.k[0].dtype)

    def packed_cuda_kernel_options(self) -> dict:
        """Options of flex's kernel on CUDA for compiled prefill over the step's K/V packed into rows."""
        return packed_prefill_options(self.kv_shape()[1], self.pool.k[0].dtype)

    @staticmethod
    def unsupported(page_size: int, device: torch.device) -> str | None:
        """Why this backend cannot run with these settings, or None."""
        if device.type == "cuda" and page_size % 16:
            return (f"on a GPU, FlexAttention's kernels read a page as one KV block of at least 16 "
                    f"tokens, so page_size must be a multiple of 16 (got {page_size})")
        return None

    @staticmethod
    def prefill_scratch_bytes(mcfg, tokens: int, itemsize: int) -> int:
        return 0  # the K/V copied into rows: within the KV sizing's margin at the sizes flexsgl serves

    @staticmethod
    def max_pool_slots(mcfg) -> int | None:
        """The pool one flex-decoding kernel reads (its 32-bit offsets, flex_ops.py). A larger pool,
        which only a max_total_tokens given asks for, is read in shards: a kernel each, their block
        lists cut and their outputs merged, every layer of every step (docs/BENCHMARKS.md)."""
        _, heads, dim = mcfg.kv_layout
        return MAX_KERNEL_ELEMENTS // (heads * dim)

    def prepare(self, fb: ForwardBatch) -> None:
        fb.attn = self.metadata(fb)

    # CUDA graphs: the BlockMask of a captured size lives in tensors the graph reads. Its step's
    # values are built inside the graph, from the static batch the graph manager has filled, and
    # copied into them: a replay rebuilds the mask on the device, with no host work per step.
    def init_graph_state(self, max_bs: int, max_pages: int) -> None:
        self.graph_meta: dict[int, FlexMeta] = {}

    def bind_graph(self, bs: int, fb: ForwardBatch) -> None:
        fb.attn = self.graph_meta[bs] = self.metadata(fb, fixed_shapes=True)

    def fill_graph(self, bs: int, fb: ForwardBatch) -> None:
        """Nothing on the host: graph_step builds the step's mask inside the graph."""

    def graph_step(self, bs: int, fb: ForwardBatch) -> None:
        for dst, src in zip(self.graph_meta[bs].step_tensors(), self.metadata(fb, fixed_shapes=True).step_tensors()):
            dst.copy_(src)

    def forward(self, q, cache, fb: ForwardBatch, variant=None, sink=None) -> torch.Tensor:
        k, v = cache
        return self.attention(q, k, v, fb, variant=variant, sink=sink)

    def attention(self, q, k, v, fb: ForwardBatch, scale: float | None = None, options: dict | None = None,
                  variant=None, sink: torch.Tensor | None = None) -> torch.Tensor:
        """q `[T, Hq, D]` over one layer's pool, k `[slots, Hkv, D]` and v `[slots, Hkv, Dv]`, as the
        step's metadata lays it out; returns `[T, Hq, Dv]`. variant: the layer's bound attention
        variant (None: plain causal); sink: its per-head sink logits `[Hq]`, where it has them."""
        meta: FlexMeta = fb.attn
        plain = variant is None or variant.plain
        if variant is not None and variant.scale is not None:
            scale = variant.scale
        if not plain:
            meta = meta.variants[variant.id]
            if options is None and self.variant_options:  # on CUDA (the CPU's kernel takes none)
                options = self.variant_options[variant.id][meta.kv_rows is not None]
        if fb.mode == "decode" and self.decode_op:
            bm = meta.block_mask
            return flex_decode(q, k, v, bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                               fb.page_table, *meta.mask_state, self.pool.page_size, scale,
                               -1 if plain else variant.id, None if plain else self.page_pos,
                               None if plain else fb.req_slots, sink)
        poisoned = None if self.compiled else _nan_writes_zeroed(k, v, fb)
        k, v = self.kv_sequence(k, fb, meta), self.kv_sequence(v, fb, meta)
        if k.dtype != q.dtype and (meta.kv_rows is not None or not (self.compiled and q.is_cuda)):
            # An FP8 cache where no Triton flex kernel casts it as it loads (SDPA, the CPU's flex
            # kernel), or packed rows, which are a copy anyway.
            k, v = k.to(q.dtype), v.to(q.dtype)
        out = self.attend(q, k, v, meta, scale, options, sink)
        return out if poisoned is None else out.masked_fill(poisoned[:, None, None], float("nan"))

    def kv_sequence(self, x: torch.Tensor, fb: ForwardBatch, meta: FlexMeta | None = None) -> torch.Tensor:
        """One layer's pool tensor `[slots, H, D]` as the step's KV sequence `[1, H, N, D]` for the
        layer's metadata `meta` (default: plain causal attention's): the step's K/V packed into rows
        where it has them (contiguous per head; a windowed variant's hold only what its window
        reaches), else the pool's slots."""
        meta = fb.attn if meta is None else meta
        kv_rows = meta.kv_rows
        if kv_rows is not None:
            packed = torch.where((kv_rows >= 0)[:, None, None], x[kv_rows.clamp(min=0)], 0)
            return packed[None].transpose(1, 2).contiguous()
        kv_slots = meta.kv_slots
        x = x[:fb.num_kv_pages * self.pool.page_size] if kv_slots is None else x[kv_slots]
        return x[None].transpose(1, 2)

    def attend(self, q, k, v, meta: FlexMeta, scale: float | None = None, options: dict | None = None,
               sink: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q `[T, Hq, D]`, laid out as the step's metadata says, over the pool read as one
        KV sequence, k `[1, Hkv, N, D]` and v `[1, Hkv, N, Dv]`; returns `[T, Hq, Dv]`. Compiled:
        flex_attention with the step's BlockMask, score_mod and `options` (default: the backend's for
        the pages or for packed rows, as meta reads); otherwise SDPA with the mask_mod's dense values,
        or the scores written out where a score_mod or a sink changes them."""
        t, hq, d = q.shape
        nb, nq = meta.query_shape
        if meta.heads_as_rows:  # on the CPU, whose flex kernel wants the query in a buffer of its own
            qb = q.new_zeros(t, 1, hq, d).index_put_((torch.arange(t, device=q.device),), q[:, None])
            return flex_attention(qb, k, v, block_mask=meta.block_mask, scale=scale,
                                  kernel_options=self.kernel_options)[:, 0]
        if meta.rows is None and not (self.compiled and q.device.type == "cpu"):
            qb = q.view(nb, nq, hq, d)  # the tokens as they come: a view, and the output one too
        else:  # placed into rows, or on the CPU, whose compiled flex kernel wants a query buffer of its own
            rows = meta.rows or (torch.zeros(t, dtype=torch.long, device=q.device), torch.arange(t, device=q.device))
            qb = q.new_zeros(nb, nq, hq, d).index_put_(rows, q)
        if self.compiled and (sink is None or q.device.type != "cpu"):
            if options is None:
                options = self.kernel_options if meta.kv_rows is None else self.packed_kernel_options
            out = flex_attention(qb.transpose(1, 2), k, v, score_mod=meta.score_mod, block_mask=meta.block_mask,
                                 scale=scale, enable_gqa=hq != k.shape[1], kernel_options=options,
                                 return_aux=None if sink is None else AuxRequest(lse=True))
            if sink is not None:
                out, aux = out
                out = with_sink(out, aux.lse * (FLASH_LSE_SCALE if options == FLASH else 1.0), sink)
        elif self.compiled:  # a sink on the CPU, whose compiled flex returns no log-sum-exp: the mask alone
            out = _scores_written_out(qb.transpose(1, 2), k, v, *_dense_from_mods(meta, nb, hq, nq, k.shape[2], q.device),
                                      scale, sink)
        elif meta.score_mod is not None or sink is not None:
            visible = meta.mask_state[0]  # [nb, nq, N], or per head [nb, Hq, nq, N]
            out = _scores_written_out(qb.transpose(1, 2), k, v, visible if visible.dim() == 4 else visible[:, None],
                                      meta.score_mod, scale, sink)
        else:  # every query as one sequence over the one KV sequence: SDPA never copies K/V per request
            visible = meta.mask_state[0]
            mask = (visible.transpose(0, 1).reshape(1, hq, nb * nq, -1) if visible.dim() == 4
                    else visible.reshape(1, 1, nb * nq, -1))
            out = F.scaled_dot_product_attention(qb.reshape(1, nb * nq, hq, d).transpose(1, 2), k, v,
                                                 attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
            out = out.view(hq, nb, nq, -1).permute(1, 0, 2, 3)
        out = out.transpose(1, 2)  # [nb, nq, Hq, Dv]
        return out.reshape(t, hq, v.shape[-1]) if meta.rows is None else out[meta.rows]


def _scores_written_out(q, k, v, visible, score, scale: float | None, sink: torch.Tensor | None) -> torch.Tensor:
    """Attention with the scores as one tensor, for a variant's score_mod or sink where flex does not
    run them (not compiled, or a sink on the CPU): q `[nb, Hq, nq, D]` over k, v `[1, Hkv, N, D]`,
    `visible` broadcasting to `[nb, Hq, nq, N]`, `score` a function of those scores (or None), the
    sink as one more column; returns `[nb, Hq, nq, Dv]`. As in flex, a row that sees nothing is zeros
    and one with a NaN score among the keys it sees is NaN (the engine then ends its request)."""
    hq, g = q.shape[1], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q.float() @ k.float().transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if score is not None:
        s = score(s)
    poisoned = (s.isnan() & visible).any(-1, keepdim=True)
    s = s.masked_fill(~visible, float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.float().view(1, hq, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :k.shape[2]]  # a row that sees nothing: zeros
    return (p @ v.float()).masked_fill(poisoned, float("nan")).to(q.dtype)


def _nan_writes_zeroed(k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """Not compiled, attention reads every request's keys at once (SDPA, the scores written out),
    and a key a row does not see still reaches it if it is NaN (NaN + -inf and 0 x NaN are NaN);
    only this step's K/V can be (the pages of a request whose logits were NaN are zeroed as it
    ends). So: this step's NaN K/V become zeros in the pool `k`, `v` `[slots, H, D]`, and the
    returned `[T]` marks the tokens of every request that wrote one, whose outputs are made NaN for
    the engine to end it; the requests beside it run on."""
    slots = fb.out_slots
    new_k, new_v = k[slots].float(), v[slots].float()
    nan = new_k.isnan().flatten(1).any(1) | new_v.isnan().flatten(1).any(1)
    k[slots] = torch.where(nan[:, None, None], 0.0, new_k).to(k.dtype)
    v[slots] = torch.where(nan[:, None, None], 0.0, new_v).to(v.dtype)
    request = torch.bucketize(torch.arange(slots.shape[0], device=slots.device), fb.q_offsets, right=True) - 1
    wrote = torch.zeros(fb.batch_size, dtype=torch.int32, device=slots.device).index_add_(0, request, nan.int())
    return wrote[request] > 0


def _dense_from_mods(meta: FlexMeta, nb: int, hq: int, nq: int, n: int, device) -> tuple:
    """(visible, score) of a compiled step's mask_mod and score_mod over every (query, key) pair: the
    mask alone is correct over the whole KV sequence (flex_masks.py)."""
    b, h, q, kv = (torch.arange(x, device=device).view(*[1] * i, x, *[1] * (3 - i)) for i, x in
                   enumerate((nb, hq, nq, n)))
    visible = meta.block_mask.mask_mod(b, h, q, kv)
    score = None if meta.score_mod is None else (lambda s: meta.score_mod(s, b, h, q, kv))
    return visible, score
