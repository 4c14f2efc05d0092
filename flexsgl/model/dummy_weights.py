"""Seeded random weights (`load_format="dummy"`), generated in blocks so that no rank ever holds
more than its part of the model and one block.

Each parameter of the whole (TP=1) model is cut into blocks of whole rows (dimension 0), about
BLOCK_ELEMENTS each, and block c of parameter i draws from its own generator, seeded from
(seed, i, c). Any slice of the parameter is then made from the blocks it crosses alone: a rank's
weight loader (flexsgl/model/weight_loaders.py) reads its slices of the whole tensor through
`DummyTensor.reader`, which writes them straight into the rank's parameter, block by block. A rank
thus holds its weights plus one block, and TP=N with dummy weights is the very model TP=1 has. The
generators differ by device, so the same model's dummy weights on a CPU and a GPU differ too.
"""

from __future__ import annotations

import math

import torch

from flexsgl.model.weight_loaders import weight_loader

BLOCK_ELEMENTS = 1 << 22  # about the elements of one generated block (8 MB in bfloat16)


class DummyTensor:
    """The random values of one whole parameter, of `shape`: N(0, 0.02), or 1 + 0.1 N(0, 1) for a
    norm's weight (`norm`), generated in `dtype` on `device`."""

    def __init__(self, shape: tuple[int, ...], key: int, device: torch.device, dtype: torch.dtype, norm: bool):
        self.shape, self.key, self.device, self.dtype, self.norm = tuple(shape), key, device, dtype, norm
        self.rows = max(1, BLOCK_ELEMENTS // max(1, math.prod(self.shape[1:])))  # rows of a block

    def reader(self, view: torch.Tensor):
        """A weight loader's read(index, out) over `view`, a view (on the meta device) of a tensor of
        the whole parameter's shape: the part of it one checkpoint tensor would fill."""
        return lambda index, out: self.fill(view if index is None else view[index], out)

    def fill(self, region: torch.Tensor, out: torch.Tensor) -> None:
        """Write the values of `region` (a meta view of the whole parameter: a slice of it, or an
        index along its first dimensions, then slices) into `out`, generating only the blocks it crosses."""
        n, k = len(self.shape), region.dim()
        strides = torch.empty(self.shape, device="meta").stride()
        if region.stride() != strides[n - k:] and math.prod(region.shape) > 1:
            raise ValueError(f"cannot read a dummy tensor of shape {self.shape} through strides {region.stride()}")
        offset, starts = region.storage_offset(), []
        for s in strides:
            starts.append(offset // s)
            offset %= s
        lengths = [1] * (n - k) + list(region.shape)
        box = out[(None,) * (n - k)]  # `out` with the indexed leading dimensions back, of length 1
        first, end = starts[0], starts[0] + lengths[0]
        rest = tuple(slice(a, a + m) for a, m in zip(starts[1:], lengths[1:]))
        for block in range(first // self.rows, -(-end // self.rows)):
            a, b = block * self.rows, min((block + 1) * self.rows, self.shape[0])
            lo, hi = max(a, first), min(b, end)
            dst = box[lo - first:hi - first]
            if (lo, hi) == (a, b) and self._drawn_in_place(dst):
                self._draw(block, dst)
            else:
                dst.copy_(self.block(block, a, b)[(slice(lo - a, hi - a),) + rest])

    def block(self, index: int, start: int, end: int) -> torch.Tensor:
        """Rows start..end of the whole parameter: block `index`, from its own generator."""
        shape = (end - start,) + self.shape[1:]
        if self.norm:
            g = self._generator(index)
            return 1.0 + 0.1 * torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)
        return self._draw(index, torch.empty(shape, dtype=self.dtype, device=self.device))

    def _drawn_in_place(self, dst: torch.Tensor) -> bool:
        """Whether a whole block's values can be drawn straight into `dst` (a contiguous tensor of
        the block's shape, dtype and device): the very values `block` would draw, without the copy."""
        return (not self.norm and tuple(dst.shape[1:]) == self.shape[1:] and dst.is_contiguous()
                and dst.dtype == self.dtype and dst.device == torch.device(self.device))

    def _draw(self, index: int, out: torch.Tensor) -> torch.Tensor:
        return out.normal_(0.0, 0.02, generator=self._generator(index))

    def _generator(self, index: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed((self.key * 1000033 + index) % (1 << 63))


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int, full: torch.nn.Module | None = None) -> None:
    """Random weights of the right shapes, generated on the model's device (for benchmarks and
    tests). A rank's part of a model (`full`: the whole model, on the meta device) gets its slices
    of the very tensors the whole model gets, through each parameter's weight loader."""
    full = model if full is None else full
    for i, ((name, p), f) in enumerate(zip(model.named_parameters(), full.parameters())):
        loader = weight_loader(p)
        shape = loader.part_of(f, None).shape  # the checkpoint tensor's (transposed, for some experts)
        whole = DummyTensor(shape, seed * 1000003 + i, p.device, p.dtype, name.endswith("norm.weight"))
        loader.load(p, whole.reader(torch.empty(shape, device="meta")), None)  # as one whole tensor
