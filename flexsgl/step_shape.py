"""A step's shapes: how many rows it runs, how wide its page table goes up, and whether a decode
step replays a CUDA graph. The one place these are decided; the planner (step/plan.py) asks here.

- Decode batches pad to a bucket when the step is compiled or graphs are captured: DECODE_BUCKETS
  where the decode backend compiles a kernel per shape (flex: one kernel per bucket),
  FINE_DECODE_BUCKETS (SGLang's spacing) for a kernel override, where a padded row costs its share
  of every projection. Once graphs are captured, a batch pads to the next captured size, and one
  larger than every captured size to the buckets above them.
- No varying dimension of a compiled prefill step is 0 or 1 (MIN_COMPILED_SIZE): torch.compile
  specialises such a dimension, so a batch-1 or one-block prefill after multi-request ones would
  recompile. A compiled prefill step gets padding requests and computes padding logits rows up to
  it; flex has at least that many query blocks (attention/flex_blocks.py).
- Page tables go up full width (the pages of the longest request the engine admits) in a compiled
  step and once graphs are captured: compiled flex's BlockMask shapes follow the table's. Where a
  kernel override reads the table on CUDA, a step that is not replayed from a graph sends it only as
  wide as its longest request (at batch 256 the full width is ~160k entries a step). A graphed step
  writes into the graph's static table: whole while it has at most WHOLE_TABLE_ENTRIES entries, else
  as wide as its longest request, into the table's leading columns (columns past a request's last
  page are read by no backend).
"""

from __future__ import annotations

from itertools import chain

MIN_COMPILED_SIZE = 2
# SGLang's spacing for a kernel override: 8 apart to 64, then 16 to 256. A padded row costs its share
# of every projection, and a batch of 200 padded to 256 wastes 28% of them.
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
FINE_DECODE_BUCKETS = (1, 2, 4, *range(8, 64, 8), *range(64, 256, 16), 256, 320, 384, 448, 512)
# A graphed step's page table up to this many entries goes up whole, straight into the static table.
WHOLE_TABLE_ENTRIES = 1 << 16


def decode_buckets(compiles_per_shape: bool, max_running: int) -> list[int]:
    """The batch sizes a decode step pads to, up to max_running."""
    buckets = DECODE_BUCKETS if compiles_per_shape else FINE_DECODE_BUCKETS
    return [b for b in buckets if b < max_running] + [max_running]


class StepShape:
    """The shape policy of the engine's steps (module docstring).

    compiled: the model runs compiled. max_pages: the page-table width of the longest request.
    num_pages: the pool's pages. per_shape: the backends whose kernels compile per shape, by mode
    ("prefill", "decode"). cuda: the step runs on a GPU."""

    def __init__(self, compiled: bool, max_running: int, max_pages: int, num_pages: int,
                 per_shape: dict[str, bool], cuda: bool):
        self.compiled, self.max_pages, self.num_pages = compiled, max_pages, num_pages
        self.buckets = decode_buckets(per_shape["decode"], max_running)
        self.full_tables = compiled  # and once graphs are captured
        self.narrow = {mode: cuda and not p for mode, p in per_shape.items()}  # tables as wide as needed
        self.graph_sizes: frozenset[int] = frozenset()

    def use_graphs(self, sizes: list[int]) -> None:
        """Decode batches of these sizes replay a CUDA graph; batches pad to the next of them (larger
        ones to the buckets above them)."""
        sizes = sorted(set(sizes))
        self.graph_sizes = frozenset(sizes)
        self.buckets = sizes + [b for b in self.buckets if b > sizes[-1]]
        self.full_tables = True

    def rows(self, mode: str, n: int) -> int:
        """Rows a step of n requests runs, padding rows included."""
        if mode == "decode":
            return next(b for b in self.buckets if b >= n) if self.compiled or self.graph_sizes else n
        return max(n, MIN_COMPILED_SIZE) if self.compiled else n

    def logits_rows(self, mode: str, rows: int, sampled: int) -> int:
        """Logits rows a step computes: every row in decode (static shapes; sampled rows come first),
        the sampled ones in prefill, at least MIN_COMPILED_SIZE compiled."""
        if mode == "decode":
            return rows
        return max(sampled, MIN_COMPILED_SIZE) if self.compiled else sampled

    def graphed(self, mode: str, rows: int) -> bool:
        """Whether the step replays a CUDA graph."""
        return mode == "decode" and rows in self.graph_sizes

    def table_width(self, mode: str, rows: int, longest: int) -> int:
        """The width of the page table a step of `rows` rows uploads, its longest request `longest` pages."""
        if self.graphed(mode, rows):
            return self.max_pages if rows * self.max_pages <= WHOLE_TABLE_ENTRIES else longest
        return self.max_pages if self.full_tables and not self.narrow[mode] else longest

    def kv_pages(self, tables: list[list[int]]) -> int:
        """Pool pages attention may see (ForwardBatch.num_kv_pages): all of them where tables go up full
        width, else up to the highest page in the step's `tables`."""
        return self.num_pages if self.full_tables else max(chain.from_iterable(tables)) + 1
