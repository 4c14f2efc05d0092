"""How checkpoint tensors land in a parameter: the per-parameter weight loader.

Each parameter may carry a WeightLoader (`param.weight_loader`, set by the model that owns it;
`weight_loader(param)` gives the one that applies, WHOLE by default). A checkpoint tensor fills a
*part* of a parameter: the whole of it (part None), one of the fused parts of a fused projection
(q, k, v of `qkv_proj` are parts 0, 1, 2; gate and up of `gate_up_proj` parts 0, 1), or one
expert's slice of a stacked expert parameter. The model maps an HF tensor name to (parameter
name, part) (`checkpoint_name`); flexsgl/model/loader.py checks every tensor against the loaders
of the whole model, then hands each to its parameter's `load`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from flexsgl.distributed.layers import Piece, Split

# read(index, out): copy the checkpoint tensor (index None) or its slice `index` (a tuple of slices)
# into `out`, a view of the parameter, reading only what is asked for (from the safetensors file, or
# generating it: flexsgl/model/dummy_weights.py), so a tensor-parallel rank reads only its slices and
# holds nothing of the whole.
Reader = Callable[[tuple | None, torch.Tensor], None]


class WeightLoader(ABC):
    """How a checkpoint fills one parameter."""

    parts: tuple = ()  # the parts a checkpoint gives one tensor each, where it does not give the whole

    @abstractmethod
    def part_of(self, full: torch.Tensor, part) -> torch.Tensor:
        """The view of the whole model's parameter `full` (its TP=1 shape) that the tensor of `part`
        fills: the shape the checkpoint's tensor must have."""

    @abstractmethod
    def load(self, param: torch.Tensor, read: Reader, part) -> None:
        """Copy the checkpoint tensor of `part` (`read`) into this rank's `param`."""

    def sharded(self, rank: int, size: int) -> "WeightLoader | None":
        """This loader for tensor-parallel rank `rank` of `size` where it splits its parameter itself
        (stacked experts); None where flexsgl/distributed/layers.py split_of says how."""
        return None


class Whole(WeightLoader):
    """A parameter filled by one checkpoint tensor of its own shape."""

    def part_of(self, full: torch.Tensor, part) -> torch.Tensor:
        return full

    def load(self, param: torch.Tensor, read: Reader, part) -> None:
        read(None, param)


WHOLE = Whole()


def weight_loader(param: torch.Tensor) -> WeightLoader:
    """The loader of `param`: its own `weight_loader`, or WHOLE."""
    return getattr(param, "weight_loader", WHOLE)


class Parts(WeightLoader):
    """A parameter made of parts along one dimension (`split`, flexsgl/distributed/layers.py): the
    fused parts of a fused projection, each given as its own tensor, and under tensor parallelism
    this rank's piece of each. Rows (or columns) that no piece fills, the padding of a
    vocabulary-parallel rank, are zeroed."""

    def __init__(self, split: Split):
        self.split = split
        self.parts = tuple(range(len(split.pieces))) if len(split.pieces) > 1 else ()

    def _start(self, part: int) -> int:
        return sum(self.split.full_parts[:part])

    def part_of(self, full: torch.Tensor, part) -> torch.Tensor:
        if part is None:
            return full
        return full.narrow(self.split.dim, self._start(part), self.split.full_parts[part])

    def load(self, param: torch.Tensor, read: Reader, part) -> None:
        s = self.split
        whole = part is None and len(s.pieces) > 1  # one tensor of every part (a fused checkpoint tensor)
        for i in range(len(s.pieces)) if part is None else (part,):
            piece, size = s.pieces[i], s.full_parts[i]
            at = self._start(i) if whole else 0  # where part i starts in the tensor read
            dst = param.narrow(s.dim, piece.at, piece.length)
            if not whole and piece.start == 0 and piece.length == size:
                read(None, dst)
            else:
                index = [slice(None)] * param.dim()
                index[s.dim] = slice(at + piece.start, at + piece.start + piece.length)
                read(tuple(index), dst)
        end = max(p.at + p.length for p in s.pieces)
        if end < param.shape[s.dim]:
            param.narrow(s.dim, end, param.shape[s.dim] - end).zero_()


class FirstRankOnly(Whole):
    """A row-parallel projection's bias: rank 0 holds it, the other ranks zeros, so the all-reduce
    of the ranks' partial sums adds it once."""

    def __init__(self, rank: int):
        self.rank = rank

    def load(self, param: torch.Tensor, read: Reader, part) -> None:
        super().load(param, read, part)
        if self.rank != 0:
            param.zero_()


def row_loader(loader: WeightLoader) -> WeightLoader:
    """The loader of a parameter holding one entry per row of the parameter `loader` fills (an FP8
    weight's scales, `[N, 1]`, or stacked experts' `[E, N, 1]`): the same loader where it splits
    rows, one that leaves every row whole where it splits columns (a row-parallel projection's input
    features, the experts' down projection's intermediate units)."""
    if isinstance(loader, Parts) and loader.split.dim != 0:
        return WHOLE
    if isinstance(loader, StackedExperts) and loader.halves == 1:
        return StackedExperts(loader.num_experts, halves=1)
    return loader


def block_loader(loader: WeightLoader, block: tuple[int, int]) -> WeightLoader | None:
    """The loader of a parameter holding one entry per `block` (rows, columns) of the parameter
    `loader` fills (a block-wise FP8 weight's scales, `[N / bn, K / bk]`; stacked experts'
    `[E, N / bn, K / bk]`, which split as their weights do): its parts and this rank's pieces in
    blocks, or None where one of them does not start and end on a block's edge."""
    if isinstance(loader, (Whole, StackedExperts)):
        return loader
    if not isinstance(loader, Parts):
        return None
    s = loader.split
    b = block[0] if s.dim == 0 else block[1]
    sizes = [n for p in s.pieces for n in (p.start, p.length, p.at)] + list(s.full_parts)
    if any(n % b for n in sizes):
        return None
    return Parts(Split(s.dim, [Piece(p.start // b, p.length // b, p.at // b) for p in s.pieces],
                       [n // b for n in s.full_parts]))


def fused_rows(sizes: list[int]) -> Parts:
    """The loader of a parameter that stacks `sizes` rows from one tensor each (no tensor parallelism)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return Parts(Split(0, [Piece(0, n, at) for n, at in zip(sizes, starts)], list(sizes)))


def packed_name(hf_name: str, packed: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """(parameter name, part) of HF tensor `hf_name`, where `packed` maps an HF module name to the
    fused module holding it and its part there (q_proj -> (qkv_proj, 0)); other names map to themselves."""
    for frag, (fused, part) in packed.items():
        if f".{frag}." in hf_name:
            return hf_name.replace(f".{frag}.", f".{fused}."), part
    return hf_name, None


def allocate(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Allocate the parameters and buffers of `model`, built on the meta device, on `device`,
    uninitialised: floating-point ones in `dtype` straight away (never a float32 copy first), the
    others, and those marked `keep_dtype` (FP8 weights and their scales), in their own dtype. Each parameter keeps its weight loader, and parameters tied before
    (one object in two places) stay tied."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        keep = not t.is_floating_point() or getattr(t, "keep_dtype", False)
        return torch.empty(t.shape, dtype=t.dtype if keep else dtype, device=device)

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in made:
                new = torch.nn.Parameter(empty(p), requires_grad=p.requires_grad)
                if hasattr(p, "weight_loader"):
                    new.weight_loader = p.weight_loader
                made[id(p)] = new
        for name, b in module._buffers.items():
            if b is not None and id(b) not in made:
                made[id(b)] = empty(b)
    for module in model.modules():
        for group in (module._parameters, module._buffers):
            for name, t in group.items():
                if t is not None:
                    group[name] = made[id(t)]


def split_loader(split: Split | None) -> WeightLoader:
    """The loader of a parameter split as `split` describes (None: held whole)."""
    return WHOLE if split is None else Parts(split)


class StackedExperts(WeightLoader):
    """Routed experts stacked along dimension 0 (`[E, rows, cols]`), from one tensor per expert and
    projection, or from the whole stack: part (expert, half) fills half `half` (0 gate, 1 up) of
    expert `expert`'s rows, or all of them when `half` is None (one projection per expert).

    Under tensor parallelism each rank holds every expert's slice `rank` of `size` of the expert's
    intermediate dimension: of gate and up their rows (`halves` 2, `[E, 2I/size, H]`; their bias's
    entries, `[E, 2I/size]`), of down its columns (`halves` 1, `[E, H, I/size]`). Down's bias
    `[E, H]` rank 0 holds whole and the other ranks as zeros: the all-reduce of the ranks' partial
    sums adds it once."""

    def __init__(self, num_experts: int, halves: int, rank: int = 0, size: int = 1):
        """halves: 2 where gate and up are fused, 1 for one projection."""
        each = (0, 1) if halves == 2 else (None,)
        self.parts = tuple((e, h) for e in range(num_experts) for h in each)
        self.num_experts, self.halves, self.rank, self.size = num_experts, halves, rank, size

    def sharded(self, rank: int, size: int) -> "StackedExperts":
        return StackedExperts(self.num_experts, self.halves, rank, size)

    def part_of(self, full: torch.Tensor, part) -> torch.Tensor:
        if part is None:
            return full
        expert, half = part
        rows = full[expert]
        return rows if half is None else rows.narrow(0, half * (rows.shape[0] // 2), rows.shape[0] // 2)

    def load(self, param: torch.Tensor, read: Reader, part) -> None:
        if self.size == 1:
            read(None, self.part_of(param, part))
            return
        lead = (slice(None),) if part is None else ()  # the whole stack's expert dimension
        dst = param if part is None else param[part[0]]
        bias = param.dim() == 2
        if self.halves == 1 and bias:
            FirstRankOnly(self.rank).load(dst, read, None)
            return
        if self.halves == 1:  # down: this rank's columns of the intermediate dimension
            cols = dst.shape[-1]
            read(lead + (slice(None), slice(self.rank * cols, (self.rank + 1) * cols)), dst)
            return
        axis = -1 if bias else -2  # gate and up: this rank's rows of each (entries of the bias)
        local = dst.shape[axis] // 2
        for half in (0, 1) if part is None or part[1] is None else (part[1],):
            at = half * local * self.size if part is None else 0  # where the half starts in what is read
            read(lead + (slice(at + self.rank * local, at + (self.rank + 1) * local),),
                 dst.narrow(axis, half * local, local))


class TransposedExperts(WeightLoader):
    """Stacked experts `[E, rows, cols]` from one tensor of the whole stack stored transposed,
    `[E, cols, rows]` (x @ W: HF's GPT-OSS layout); with `interleaved`, a stacked gate_up (gate rows,
    then up rows) from a tensor whose gate and up alternate (gate in even columns, up in odd ones),
    or its bias `[E, 2I]` from one whose entries alternate so.

    Under tensor parallelism each rank holds every expert's slice `rank` of `size` of the
    intermediate dimension I: gate_up's columns (and bias entries) 2i and 2i + 1 for its i, one
    contiguous block of the interleaved tensor; down's rows of the transposed `[E, I, H]`."""

    def __init__(self, interleaved: bool, rank: int = 0, size: int = 1):
        self.interleaved, self.rank, self.size = interleaved, rank, size

    def sharded(self, rank: int, size: int) -> "TransposedExperts":
        return TransposedExperts(self.interleaved, rank, size)

    def part_of(self, full: torch.Tensor, part) -> torch.Tensor:
        return full.transpose(1, 2) if full.dim() == 3 else full  # the checkpoint tensor's shape

    def load(self, param: torch.Tensor, read: Reader, part) -> None:
        src = torch.empty(self.part_of(param, part).shape, dtype=param.dtype, device=param.device)
        if self.size == 1:
            read(None, src)
        else:  # this rank's block of the intermediate dimension: the last of gate_up, dimension 1 of down
            axis = src.dim() - 1 if self.interleaved else 1
            n = src.shape[axis]
            index = [slice(None)] * src.dim()
            index[axis] = slice(self.rank * n, (self.rank + 1) * n)
            read(tuple(index), src)
        e, rows = param.shape[:2]
        if not self.interleaved:
            param.copy_(src.transpose(1, 2))
        elif param.dim() == 3:  # [E, H, I, 2] (column 2i + half) -> [E, 2, I, H]
            param.view(e, 2, rows // 2, -1).copy_(src.reshape(e, src.shape[1], rows // 2, 2).permute(0, 3, 2, 1))
        else:  # the bias: [E, I, 2] -> [E, 2, I]
            param.view(e, 2, rows // 2).copy_(src.reshape(e, rows // 2, 2).transpose(1, 2))
