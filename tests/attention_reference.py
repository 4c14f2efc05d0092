"""Random paged layouts and a float64 dense attention to check backends against."""

from __future__ import annotations

import random

import torch

from flexsgl.attention.base import ForwardBatch
from flexsgl.cache.pool import DUMMY_PAGE, KVPool, PageAllocator


def random_paged_batch(pool: KVPool, alloc: PageAllocator, specs, hq: int, device, dtype, rng: random.Random):
    """specs: list of (prefix_len, new_len). Fills the prefixes' K/V with random values, returns
    (fb, q, k, v, dense) where dense[i] = (K_i, V_i) float64 of the whole sequence of request i;
    q is rounded to `dtype`, K and V to the pool's (an FP8 pool's: FP8 values)."""
    ps = pool.page_size
    hkv, d = pool.k[0].shape[1], pool.k[0].shape[2]
    tables, dense, ids, pos, slots = [], [], [], [], []
    q_lens, seq_lens, offsets = [], [], []
    for prefix, new in specs:
        total = prefix + new
        pages = alloc.alloc(KVPool.num_pages_for(total, ps))
        # Rounded to the pool's dtype, so the reference sees exactly what the kernel reads.
        kfull = torch.randn(total, hkv, d, dtype=torch.float64).float().to(pool.k[0].dtype).double()
        vfull = torch.randn(total, hkv, d, dtype=torch.float64).float().to(pool.k[0].dtype).double()
        s = torch.tensor([pages[p // ps] * ps + p % ps for p in range(total)])
        for layer in range(len(pool.k)):  # the cached prefix, already in the pool
            pool.store(layer, kfull[:prefix].to(device, dtype), vfull[:prefix].to(device, dtype), s[:prefix].to(device))
        offsets.append(len(pos))
        pos += list(range(prefix, total))
        slots += s[prefix:].tolist()
        tables.append(pages)
        dense.append((kfull, vfull))
        q_lens.append(new)
        seq_lens.append(total)
    w = max(len(t) for t in tables)
    table = torch.tensor([t + [DUMMY_PAGE] * (w - len(t)) for t in tables], dtype=torch.int32)
    t_total = len(pos)
    knew = torch.cat([dk[p:] for (dk, _), (p, _) in zip(dense, specs)])
    vnew = torch.cat([dv[p:] for (_, dv), (p, _) in zip(dense, specs)])
    q = torch.randn(t_total, hq, d, dtype=torch.float64).to(dtype).double()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)
    fb = ForwardBatch(
        mode="decode" if all(n == 1 for _, n in specs) else "prefill",
        input_ids=torch.zeros(t_total, dtype=torch.long, device=device),
        positions=torch.tensor(pos, device=device), out_slots=torch.tensor(slots, device=device),
        page_table=table.to(device), seq_lens=i32(seq_lens), q_lens=i32(q_lens), q_offsets=i32(offsets),
        logits_index=torch.tensor([o + n - 1 for o, n in zip(offsets, q_lens)], device=device),
        max_q_len=max(q_lens), num_kv_pages=pool.num_pages,
        host_seq_lens=seq_lens, host_q_lens=q_lens, host_pages=tables,
        req_slots=torch.tensor(rng.sample(range(2 * len(specs)), len(specs)), device=device),
    )
    return fb, q, knew, vnew, dense


def dense_attention(q, dense, specs) -> torch.Tensor:
    """float64 causal attention of each request's new tokens over its whole K/V sequence."""
    outs, off = [], 0
    for (kfull, vfull), (prefix, new) in zip(dense, specs):
        qi = q[off:off + new].double()  # [n, Hq, D]
        off += new
        g = qi.shape[1] // kfull.shape[1]
        k = kfull.repeat_interleave(g, dim=1)
        v = vfull.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) / qi.shape[-1] ** 0.5
        qpos = torch.arange(prefix, prefix + new)[:, None]
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


def dense_variant_attention(q, dense, specs, visible, score=None, sink=None, scale=None) -> torch.Tensor:
    """float64 attention of each request's new tokens over its whole K/V sequence, as a variant in
    logical coordinates defines it: visible(i, h, q_pos, kv_pos) -> bool over broadcast index
    tensors (i: the request's index in specs), score(s, i, h, q_pos, kv_pos) -> s, sink [Hq] (a
    logit in every softmax's denominator whose value is zero), scale (default 1/sqrt(D))."""
    outs, off = [], 0
    for i, ((kfull, vfull), (prefix, new)) in enumerate(zip(dense, specs)):
        qi = q[off:off + new].double()
        off += new
        g = qi.shape[1] // kfull.shape[1]
        k, v = kfull.repeat_interleave(g, dim=1), vfull.repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * (qi.shape[-1] ** -0.5 if scale is None else scale)
        h = torch.arange(qi.shape[1])[:, None, None]
        qpos = torch.arange(prefix, prefix + new)[None, :, None]
        kvpos = torch.arange(k.shape[0])[None, None, :]
        if score is not None:
            s = score(s, torch.tensor(i), h, qpos, kvpos)
        s = s.masked_fill(~visible(torch.tensor(i), h, qpos, kvpos).expand(s.shape), float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.double().view(-1, 1, 1).expand(s.shape[0], s.shape[1], 1)], dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)[..., :k.shape[0]]
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.cat(outs)
