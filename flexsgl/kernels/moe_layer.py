"""One token's DeepSeek MoE layer (decode at batch 1) in one launch: routing, every slot's gate/up,
SiLU and down, and the sum of the slots with the residual.

    y = residual + sum over routed slots s of weight_s * expert_s(norm(x)) + shared(norm(x))

Launched as the four steps it is (routing, gate/up, down, the sum), each short kernel waits for the
one before to drain and then ramps its loads up again (figures: docs/BENCHMARKS.md, "H200: batch-1
kernels"). Here the steps are tasks of one grid, and a task waits only for the tasks whose output
it reads, through counters in global memory:

- route (one program per router row): its float32 logit of the RMS-normed input; the last to finish
  (an atomic count) takes softmax, greedy top-k and the weights' normalisation, as `MoE.route`
  (flexsgl/model/moe.py), and raises the `routed` flag.
- gate/up (BLOCK_A rows of one slot's [2I, H] weight: the gate rows of BLOCK_A / 2 intermediate
  units and their up rows): writes those units' SiLU(gate) * up (float32), so each slot's
  activation is computed once, not by each of its down tasks. The shared experts' slots need no
  routing and come first, so they run while the routing finishes; a routed slot waits for the flag.
  Each task counts itself into its slot's `ready` count when its units are written.
- down (BLOCK_B rows of one slot's [H, I] weight): loads its first weight tile (a routed slot's once
  the flag is up), then waits until its slot's `ready` count is full, so a slot's down starts while
  other slots' gate/up still run. The routing weight scales its output (float32, into a slot row
  of scratch); the last of a row block's slots to finish (an atomic count) adds the block's slots
  and the residual into y.

The shared MLP (`[2 J I, H]` gate/up, `[H, J I]` down) runs as J slots of a routed expert's shape,
read from its own weights and unscaled, so every task of a phase does the same work. With `experts`
and `weights` given (DeepSeek's group-limited routing, computed in PyTorch) the route tasks are left
out. Routed experts held in FP8 (float8_e4m3fn, one float32 scale per row, flexsgl/model/moe.py
Experts) are read as their FP8 bytes, widened in registers, and each row's sum multiplied by its
scale; the shared experts stay in the model's dtype.

Tasks are numbered by a ticket each program takes from an atomic counter as it starts, route tasks
first, then gate/up, then down. A task only ever waits for tasks of lower tickets, which programs
already running hold, so the grid makes progress however few of its programs fit on the GPU at once
(the order blockIdx would give is not promised). Every counter is set back to zero by the last
task that reads it, so a launch leaves its counters as it found them: all zero.
"""

from __future__ import annotations

import functools

import torch

from flexsgl.kernels.launch import pdl

# (BLOCK_A, BLOCK_K_A, BLOCK_B, BLOCK_K_B, warps, stages): the fastest of the tile sets timed on
# DeepSeek-V2-Lite's 26 MoE layers chained in one CUDA graph
CONFIG = (16, 256, 16, 256, 8, 4)


def counters_size(hidden: int, slots: int) -> int:
    """int32 counters a layer of `hidden` with `slots` expert slots (routed + shared) needs: the ticket,
    the route tasks' count, the routed flag, the finished down tasks; per slot its ready and read
    counts; per row block of down its slots done."""
    return 4 + 2 * slots + -(-hidden // CONFIG[2])


@functools.cache
def _kernel():
    # module globals, where Triton looks for them
    global tl, route_task, wait_until_routed, normed_rows, gate_up_task, rows_times_acts, down_task
    import triton
    import triton.language as tl

    @triton.jit
    def route_task(t, x_ptr, g_ptr, eps, gate_ptr, logits_ptr, count_ptr, experts_ptr, weights_ptr, routed_ptr,
                   scaling, H: tl.constexpr, E: tl.constexpr, TOP_K: tl.constexpr, NORM_TOPK: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        cols = tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
        squares = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for k in range(0, H, BLOCK_H):
            k_ok = k + cols < H
            x = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            squares += x * x
            x *= tl.load(g_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.load(gate_ptr + t * H + k + cols, mask=k_ok, other=0.0).to(tl.float32) * x
        logit = tl.sum(acc, axis=0) * tl.rsqrt(tl.sum(squares, axis=0) / H + eps)
        tl.store(logits_ptr + t, logit)
        tl.debug_barrier()  # every thread's store before the count (the release covers them)
        if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == E - 1:  # the last: every logit is written
            rows = tl.arange(0, BLOCK_E)
            logits = tl.load(logits_ptr + rows, mask=rows < E, other=float("-inf"), cache_modifier=".cg")
            p = tl.exp(logits - tl.max(logits, axis=0))
            p = p / tl.sum(p, axis=0)
            slots = tl.arange(0, BLOCK_K)
            chosen = tl.zeros((BLOCK_K,), dtype=tl.int32)
            chosen_p = tl.zeros((BLOCK_K,), dtype=tl.float32)
            left = tl.where(rows < E, p, -1.0)
            for i in tl.static_range(TOP_K):  # the largest left; a tie goes to the lower expert
                best_p = tl.max(left, axis=0)
                best = tl.min(tl.where(left == best_p, rows, BLOCK_E), axis=0)
                chosen = tl.where(slots == i, best, chosen)
                chosen_p = tl.where(slots == i, best_p, chosen_p)
                left = tl.where(rows == best, -1.0, left)
            if NORM_TOPK:
                chosen_p = chosen_p / (tl.sum(chosen_p, axis=0) + 1e-20)
            else:
                chosen_p = chosen_p * scaling
            tl.store(experts_ptr + slots, chosen, mask=slots < TOP_K)
            tl.store(weights_ptr + slots, chosen_p, mask=slots < TOP_K)
            tl.atomic_xchg(count_ptr, 0, sem="relaxed")
            tl.debug_barrier()
            tl.atomic_xchg(routed_ptr, 1, sem="release", scope="gpu")

    @triton.jit
    def wait_until_routed(routed_ptr):
        """Spin until the route tasks raised the flag; then the chosen experts and weights are readable."""
        while tl.atomic_add(routed_ptr, 0, sem="acquire", scope="gpu") == 0:
            pass
        tl.debug_barrier()

    @triton.jit
    def normed_rows(w_ptrs, row_ok, x_ptr, g_ptr, eps, H: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
        """Each weight row at `w_ptrs` (a BLOCK_K slice's pointers) times the RMS-normed x, float32."""
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k in range(0, H, BLOCK_K):
            k_ok = k + cols < H
            w = tl.load(w_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            squares += x * x
            x *= tl.load(g_ptr + k + cols, mask=k_ok, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * x[None, :]
        return tl.sum(acc, axis=1) * tl.rsqrt(tl.sum(squares, axis=0) / H + eps)

    @triton.jit
    def gate_up_task(a, x_ptr, g_ptr, eps, experts_ptr, w_ptr, stride_we, stride_wn, scale_ptr, shared_ptr,
                     stride_sn, acts_ptr, ready_ptr, routed_ptr, H: tl.constexpr, I: tl.constexpr,
                     ROUTED: tl.constexpr, J: tl.constexpr, ROUTE: tl.constexpr, HAS_SCALE: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        HALF: tl.constexpr = BLOCK_N // 2
        TILES: tl.constexpr = (I + HALF - 1) // HALF
        s = (a // TILES + ROUTED) % (ROUTED + J)  # the shared slots first: they wait for nothing
        tile = a % TILES
        r = tl.arange(0, BLOCK_N)
        i = tile * HALF + r % HALF  # the tile's intermediate units: their gate rows, then their up rows
        row_ok = i < I
        rows = i + tl.where(r >= HALF, I, 0)
        cols = tl.arange(0, BLOCK_K)
        # each branch reads its own weights (a routed expert's may be FP8, the shared ones' not)
        if s < ROUTED:
            if ROUTE:
                wait_until_routed(routed_ptr)
            e = tl.load(experts_ptr + s, cache_modifier=".cg").to(tl.int64)
            routed_ptrs = w_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
            sums = normed_rows(routed_ptrs, row_ok, x_ptr, g_ptr, eps, H, BLOCK_N, BLOCK_K)
            if HAS_SCALE:  # scales [E, 2I, 1]
                sums *= tl.load(scale_ptr + e * (2 * I) + rows, mask=row_ok, other=0.0)
        else:  # shared slice j: the MLP's gate rows j*I.., then its up rows J*I + j*I..
            w_rows = rows + (s - ROUTED) * I + tl.where(rows >= I, (J - 1) * I, 0)
            shared_ptrs = shared_ptr + w_rows[:, None].to(tl.int64) * stride_sn + cols[None, :]
            sums = normed_rows(shared_ptrs, row_ok, x_ptr, g_ptr, eps, H, BLOCK_N, BLOCK_K)
        out = tl.reshape(sums, (2, HALF))
        half = tl.arange(0, 2)[:, None]
        gate = tl.sum(tl.where(half == 0, out, 0.0), axis=0)
        up = tl.sum(tl.where(half == 1, out, 0.0), axis=0)
        units = tile * HALF + tl.arange(0, HALF)
        tl.store(acts_ptr + s * I + units, gate / (1.0 + tl.exp(-gate)) * up, mask=units < I)
        tl.debug_barrier()
        tl.atomic_add(ready_ptr + s, 1, sem="release", scope="gpu")

    @triton.jit
    def rows_times_acts(w_ptrs, row_ok, a_ptr, ready_ptr, TILES_A: tl.constexpr, I: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Each weight row at `w_ptrs` times the slot's activations at `a_ptr`, float32: the first
        weight slice loads before waiting until the slot's gate/up tasks (TILES_A, counted at
        `ready_ptr`) have written them."""
        cols = tl.arange(0, BLOCK_K)
        w_first = tl.load(w_ptrs, mask=row_ok[:, None] & (cols < I)[None, :], other=0.0, eviction_policy="evict_first")
        while tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu") < TILES_A:
            pass
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, I, BLOCK_K):
            k_ok = k + cols < I
            if k == 0:
                w = w_first
            else:
                w = tl.load(w_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
            act = tl.load(a_ptr + k + cols, mask=k_ok, other=0.0, cache_modifier=".cg")
            acc += w.to(tl.float32) * act[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def down_task(d, experts_ptr, weights_ptr, w_ptr, stride_we, stride_wn, scale_ptr, shared_ptr, stride_sn,
                  acts_ptr, slots_ptr, res_ptr, y_ptr, ready_ptr, read_ptr, rows_done_ptr, routed_ptr,
                  H: tl.constexpr, I: tl.constexpr, ROUTED: tl.constexpr, SLOTS: tl.constexpr,
                  TILES_A: tl.constexpr, ROUTE: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
        TILES: tl.constexpr = (H + BLOCK_N - 1) // BLOCK_N
        s = (d // TILES + ROUTED) % SLOTS  # the shared slots first, as their gate/up
        r = d % TILES
        rows = r * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < H
        cols = tl.arange(0, BLOCK_K)
        a_ptr = acts_ptr + s * I
        if s < ROUTED:
            if ROUTE:  # this slot's gate/up tasks started first, but may still be waiting for the routing too
                wait_until_routed(routed_ptr)
            e = tl.load(experts_ptr + s, cache_modifier=".cg").to(tl.int64)
            routed_ptrs = w_ptr + e * stride_we + rows[:, None].to(tl.int64) * stride_wn + cols[None, :]
            out = rows_times_acts(routed_ptrs, row_ok, a_ptr, ready_ptr + s, TILES_A, I, BLOCK_N, BLOCK_K)
            if HAS_SCALE:  # scales [E, H, 1]
                out *= tl.load(scale_ptr + e * H + rows, mask=row_ok, other=0.0)
            out *= tl.load(weights_ptr + s, cache_modifier=".cg").to(tl.float32)
        else:  # shared slice j: the MLP's columns j*I..
            shared_ptrs = shared_ptr + rows[:, None].to(tl.int64) * stride_sn + (s - ROUTED) * I + cols[None, :]
            out = rows_times_acts(shared_ptrs, row_ok, a_ptr, ready_ptr + s, TILES_A, I, BLOCK_N, BLOCK_K)
        tl.debug_barrier()  # every thread's reads of the slot's activations before the count
        if tl.atomic_add(read_ptr + s, 1, sem="relaxed") == TILES - 1:  # the slot's last reader
            tl.atomic_xchg(ready_ptr + s, 0, sem="relaxed")
            tl.atomic_xchg(read_ptr + s, 0, sem="relaxed")
        tl.store(slots_ptr + s * H + rows, out, mask=row_ok)
        tl.debug_barrier()
        if tl.atomic_add(rows_done_ptr + r, 1, sem="acq_rel", scope="gpu") == SLOTS - 1:  # the block's last slot
            total = tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            for q in range(SLOTS):
                total += tl.load(slots_ptr + q * H + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=row_ok)
            tl.atomic_xchg(rows_done_ptr + r, 0, sem="relaxed")

    @triton.jit
    def moe_layer_kernel(x_ptr, g_ptr, eps, res_ptr, y_ptr, gate_ptr, logits_ptr, experts_ptr, weights_ptr, scaling,
                         gu_ptr, gu_se, gu_sn, gu_scale_ptr, sgu_ptr, sgu_sn, dn_ptr, dn_se, dn_sn, dn_scale_ptr,
                         sdn_ptr, sdn_sn, acts_ptr, slots_ptr, counters_ptr,
                         H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, ROUTED: tl.constexpr, J: tl.constexpr,
                         ROUTE: tl.constexpr, NORM_TOPK: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr,
                         BLOCK_A: tl.constexpr, BLOCK_K_A: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_K_B: tl.constexpr, PDL: tl.constexpr):
        SLOTS: tl.constexpr = ROUTED + J
        TILES_A: tl.constexpr = (I + BLOCK_A // 2 - 1) // (BLOCK_A // 2)
        TILES_B: tl.constexpr = (H + BLOCK_B - 1) // BLOCK_B
        ROUTE_TASKS: tl.constexpr = E if ROUTE else 0
        TASKS: tl.constexpr = ROUTE_TASKS + SLOTS * (TILES_A + TILES_B)
        t = tl.atomic_add(counters_ptr + 0, 1, sem="relaxed")
        if t == TASKS - 1:  # every ticket is handed out
            tl.atomic_xchg(counters_ptr + 0, 0, sem="relaxed")
        if PDL:  # x and the residual come from the kernel before (launch.py)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        ready_ptr = counters_ptr + 4
        if t < ROUTE_TASKS:
            route_task(t, x_ptr, g_ptr, eps, gate_ptr, logits_ptr, counters_ptr + 1, experts_ptr, weights_ptr,
                       counters_ptr + 2, scaling, H, E, ROUTED, NORM_TOPK, BLOCK_H, BLOCK_E, BLOCK_TOP)
        elif t < ROUTE_TASKS + SLOTS * TILES_A:
            gate_up_task(t - ROUTE_TASKS, x_ptr, g_ptr, eps, experts_ptr, gu_ptr, gu_se, gu_sn, gu_scale_ptr, sgu_ptr,
                         sgu_sn, acts_ptr, ready_ptr, counters_ptr + 2, H, I, ROUTED, J, ROUTE, HAS_SCALE, BLOCK_A,
                         BLOCK_K_A)
        else:
            down_task(t - ROUTE_TASKS - SLOTS * TILES_A, experts_ptr, weights_ptr, dn_ptr, dn_se, dn_sn, dn_scale_ptr,
                      sdn_ptr, sdn_sn, acts_ptr, slots_ptr, res_ptr, y_ptr, ready_ptr, ready_ptr + SLOTS,
                      ready_ptr + 2 * SLOTS, counters_ptr + 2, H, I, ROUTED, SLOTS, TILES_A, ROUTE, HAS_SCALE, BLOCK_B,
                      BLOCK_K_B)
            if ROUTE:
                if tl.atomic_add(counters_ptr + 3, 1, sem="relaxed") == SLOTS * TILES_B - 1:  # the last task
                    tl.atomic_xchg(counters_ptr + 2, 0, sem="relaxed")
                    tl.atomic_xchg(counters_ptr + 3, 0, sem="relaxed")

    return moe_layer_kernel


def launch(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
           down: torch.Tensor, shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None,
           counters: torch.Tensor, router: torch.Tensor | None = None, top_k: int = 0, norm_topk: bool = False,
           scaling: float = 1.0, experts: torch.Tensor | None = None, weights: torch.Tensor | None = None,
           gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [1, H], experts int32 [top_k], weights float32 [top_k]) for one token: x and residual `[1, H]`
    contiguous, the RMSNorm's weight, the stacked experts `gate_up [E, 2I, H]`, `down [E, H, I]`, the
    shared MLP's `[2 J I, H]` and `[H, J I]` (or None), and int32 `counters` of `counters_size`
    zeros. Routes with `router [E, H]` (greedy top-k), or takes `experts` and `weights` as given.
    FP8 experts come with their float32 scales per row, `gate_up_scale [E, 2I, 1]` and
    `down_scale [E, H, 1]`, contiguous."""
    import triton

    n_experts, two_i, hidden = gate_up.shape
    route = router is not None
    if route:
        experts = torch.empty(top_k, dtype=torch.int32, device=x.device)
        weights = torch.empty(top_k, dtype=torch.float32, device=x.device)
    routed = experts.numel()
    j = 0 if shared_gate_up is None else shared_gate_up.shape[0] // two_i
    block_a, block_k_a, block_b, block_k_b, warps, stages = CONFIG
    tasks = (n_experts if route else 0) + (routed + j) * (triton.cdiv(two_i // 2, block_a // 2) + triton.cdiv(hidden, block_b))
    acts = torch.empty(routed + j, two_i // 2, dtype=torch.float32, device=x.device)
    slots = torch.empty(routed + j, hidden, dtype=torch.float32, device=x.device)
    logits = torch.empty(n_experts, dtype=torch.float32, device=x.device)
    y = torch.empty_like(residual)
    sgu = shared_gate_up if j else gate_up[0]
    sdn = shared_down if j else down[0]
    use_pdl = pdl(x.device)
    scaled = gate_up_scale is not None
    _kernel()[(tasks,)](
        x, norm_weight, eps, residual, y, router if route else gate_up, logits, experts, weights, scaling,
        gate_up, gate_up.stride(0), gate_up.stride(1), gate_up_scale if scaled else logits, sgu, sgu.stride(0),
        down, down.stride(0), down.stride(1), down_scale if scaled else logits, sdn, sdn.stride(0), acts, slots,
        counters, H=hidden, I=two_i // 2, E=n_experts, ROUTED=routed, J=j, ROUTE=route, NORM_TOPK=norm_topk,
        HAS_SCALE=scaled,
        BLOCK_H=min(triton.next_power_of_2(hidden), 2048), BLOCK_E=triton.next_power_of_2(n_experts),
        BLOCK_TOP=triton.next_power_of_2(max(routed, 1)), BLOCK_A=block_a,
        BLOCK_K_A=min(block_k_a, triton.next_power_of_2(hidden)),
        BLOCK_B=block_b, BLOCK_K_B=min(block_k_b, triton.next_power_of_2(two_i // 2)), PDL=use_pdl,
        num_warps=warps, num_stages=stages, **({"launch_pdl": True} if use_pdl else {}))
    return y, experts, weights


@torch.library.custom_op("flexsgl::moe_layer", mutates_args=("counters",))
def moe_layer(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
              down: torch.Tensor, shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None,
              counters: torch.Tensor, router: torch.Tensor | None, top_k: int, norm_topk: bool, scaling: float,
              experts: torch.Tensor | None, weights: torch.Tensor | None, gate_up_scale: torch.Tensor | None,
              down_scale: torch.Tensor | None) -> torch.Tensor:
    if experts is not None:
        experts, weights = experts.reshape(-1).contiguous(), weights.reshape(-1).float().contiguous()
    return launch(x.contiguous(), residual.contiguous(), norm_weight, eps, gate_up, down, shared_gate_up, shared_down,
                  counters, router, top_k, norm_topk, scaling, experts, weights, gate_up_scale, down_scale)[0]


@moe_layer.register_fake
def _(x, residual, norm_weight, eps, gate_up, down, shared_gate_up, shared_down, counters, router, top_k, norm_topk,
      scaling, experts, weights, gate_up_scale, down_scale):
    return torch.empty_like(residual)
