"""The phase router's DecodeBySize: every call the model makes on its step's backend goes to the
backend that owns the batch size (a call it lacked broke MLA models with a small-decode override)."""

import torch

from flexsgl.attention.base import AttentionBackend
from flexsgl.attention.router import DecodeBySize


class Recording(AttentionBackend):
    def __init__(self, name: str, expands: bool):
        self.name, self.expands, self.calls = name, expands, []

    def prepare(self, fb):
        self.calls.append("prepare")

    def forward(self, q, cache, fb, variant=None, sink=None):
        self.calls.append("forward")
        return q * (2 if self.expands else 3)

    def expands_latents(self, fb):
        self.calls.append("expands_latents")
        return self.expands

    def init_graph_state(self, max_bs, max_pages):
        self.calls.append("init_graph_state")

    def bind_graph(self, bs, fb):
        self.calls.append("bind_graph")

    def fill_graph(self, bs, fb):
        self.calls.append("fill_graph")


class Batch:
    def __init__(self, batch_size: int):
        self.batch_size, self.mode = batch_size, "decode"


def test_decode_by_size_sends_each_model_call_to_the_owner_of_the_batch_size():
    small, large = Recording("small", True), Recording("large", False)
    router = DecodeBySize(small, 4, large)
    q = torch.randn(3, 2)
    for bs, owner, other, factor in ((4, small, large, 2), (5, large, small, 3)):
        fb = Batch(bs)
        router.prepare(fb)
        assert router.expands_latents(fb) is owner.expands
        torch.testing.assert_close(router.forward(q, None, fb), q * factor)
        assert owner.calls == ["prepare", "expands_latents", "forward"] and other.calls == []
        owner.calls.clear()
