"""The step shape policy (flexsgl/step_shape.py): bucket choice, padding rows and page-table width,
against cases worked out by hand from the rules in its docstring."""

import pytest

from flexsgl import step_shape
from flexsgl.cache.pool import DUMMY_PAGE
from flexsgl.step.plan import padding_plan
from flexsgl.step_shape import StepShape, decode_buckets

FLEX = {"prefill": True, "decode": True}  # kernels compiled per shape
OVERRIDE = {"prefill": False, "decode": False}  # one op for any shape


def test_decode_buckets():
    assert decode_buckets(True, 100) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]
    assert decode_buckets(False, 20) == [1, 2, 4, 8, 16, 20]
    assert decode_buckets(False, 70) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 70]
    assert decode_buckets(True, 4) == [1, 2, 4]


def test_compiled_steps_pad_to_buckets_and_two_rows():
    shape = StepShape(True, 100, 64, 1000, FLEX, cuda=True)
    assert [shape.rows("decode", n) for n in (1, 3, 5, 33, 97, 100)] == [1, 4, 8, 48, 100, 100]
    assert [shape.rows("prefill", n) for n in (1, 2, 7)] == [2, 2, 7]
    assert shape.logits_rows("decode", 4, 3) == 4  # every row, padding included
    assert [shape.logits_rows("prefill", 2, s) for s in (0, 1, 2)] == [2, 2, 2]
    assert shape.logits_rows("prefill", 5, 3) == 3
    assert not shape.graphed("decode", 4)


def test_eager_steps_are_not_padded():
    shape = StepShape(False, 100, 64, 1000, FLEX, cuda=True)
    assert [shape.rows("decode", n) for n in (1, 3, 5)] == [1, 3, 5]
    assert shape.rows("prefill", 1) == 1 and shape.logits_rows("prefill", 1, 0) == 0
    assert shape.table_width("decode", 3, 7) == 7 and shape.table_width("prefill", 1, 9) == 9
    assert shape.kv_pages([[5, 2], [9], [DUMMY_PAGE]]) == 10  # up to the highest page the step holds


@pytest.mark.parametrize("per_shape,cuda,width", [(FLEX, True, 64), (OVERRIDE, True, 7), (OVERRIDE, False, 64)],
                         ids=["flex", "override-cuda", "override-cpu"])
def test_compiled_table_width(per_shape, cuda, width):
    """Full width for compiled flex; a kernel override on CUDA only as wide as the longest request."""
    shape = StepShape(True, 100, 64, 1000, per_shape, cuda=cuda)
    assert shape.table_width("decode", 4, 7) == width
    assert shape.table_width("prefill", 2, 7) == width
    assert shape.kv_pages([[5], [9]]) == 1000  # compiled: every pool page


def test_graphed_steps(monkeypatch):
    """A compiled override with graphs of 1, 2 and 8: batches pad to the captured sizes, then to the
    fine buckets above them; a graphed table goes up whole while it has at most
    WHOLE_TABLE_ENTRIES entries."""
    shape = StepShape(True, 100, 64, 1000, OVERRIDE, cuda=True)
    shape.use_graphs([8, 2, 1, 2])
    assert shape.buckets == [1, 2, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert [shape.rows("decode", n) for n in (1, 2, 3, 9, 100)] == [1, 2, 8, 16, 100]
    assert [shape.graphed("decode", n) for n in (1, 2, 8, 16)] == [True, True, True, False]
    assert not shape.graphed("prefill", 2)
    assert shape.table_width("decode", 8, 7) == 64  # 8 x 64 entries: whole
    assert shape.table_width("decode", 16, 7) == 7  # not graphed: the override's narrow table
    monkeypatch.setattr(step_shape, "WHOLE_TABLE_ENTRIES", 8 * 64 - 1)
    assert shape.table_width("decode", 8, 7) == 7  # one entry too many: as wide as the longest request
    assert shape.table_width("decode", 2, 7) == 64


def test_eager_steps_with_graphs():
    """Eager flex with graphs captured: decode pads to the captured sizes, prefill does not pad, and
    tables go up full width over the whole pool."""
    shape = StepShape(False, 16, 64, 1000, FLEX, cuda=True)
    shape.use_graphs([1, 4])
    assert shape.buckets == [1, 4, 8, 16]
    assert [shape.rows("decode", n) for n in (1, 2, 5)] == [1, 4, 8]
    assert shape.rows("prefill", 1) == 1
    assert shape.table_width("prefill", 1, 9) == 64 and shape.table_width("decode", 8, 9) == 64
    assert shape.kv_pages([[5]]) == 1000


def test_padding_plan_is_rows_on_the_dummy_page():
    """What a graph is captured on: every row one token at position 0, on the dummy page, reading
    and writing the pad slot, sampling nothing."""
    shape = StepShape(True, 8, 5, 100, FLEX, cuda=False)
    shape.use_graphs([2, 4])
    plan = padding_plan(4, shape, page_size=16, pad_slot=8)
    assert plan.graphed and plan.mode == "decode" and plan.width == 5
    assert plan.tables == [[DUMMY_PAGE]] * 4 and plan.seq_lens == [1] * 4 and plan.q_lens == [1] * 4
    assert plan.positions == [0] * 4 and plan.slots == [DUMMY_PAGE * 16] * 4
    assert plan.decode_slots == [8] * 4 and plan.write_slots == [] and plan.flags.rows == 0
    assert plan.offsets == [0, 1, 2, 3] and plan.logits_index == [0, 1, 2, 3]
