"""Start-up does no work its run does not use: a model built for loading runs no initialiser (its
values come from the checkpoint alone)."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from flexsgl.model.empty_init import no_init
from flexsgl.model.loader import build_model
from flexsgl.model.presets import DEFAULT_MODEL, EMBEDDED
from flexsgl.model.source import resolve

CPU = torch.device("cpu")


@pytest.fixture
def random_fills(monkeypatch):
    """The random fills called from now on, by name (nn.Linear's and nn.Embedding's initialisers end
    in one)."""
    calls = []
    for name in ("normal_", "uniform_"):
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def test_a_model_built_for_loading_runs_no_initialiser(random_fills):
    """Building the embedded model runs no random fill, and every parameter then holds the
    checkpoint's tensor (a fused parameter, each part's)."""
    model = build_model(resolve(DEFAULT_MODEL), CPU, torch.float32)
    assert random_fills == []
    params = dict(model.named_parameters())
    filled = set()
    for name, tensor in load_file(EMBEDDED[DEFAULT_MODEL] / "model.safetensors").items():
        target, part = model.checkpoint_name(name)
        p = params[target]
        held = p if part is None else p.weight_loader.part_of(p, part)
        assert torch.equal(held, tensor.float()), name
        filled.add(target)
    assert filled == set(params)


def test_no_init_skips_initialisers_of_meta_tensors_only(random_fills):
    """Inside no_init a module built on the meta device runs no random fill; a CPU tensor is still
    filled."""
    with no_init():
        with torch.device("meta"):
            nn.Linear(8, 8)
            nn.init.normal_(nn.Embedding(8, 4).weight)
        assert random_fills == []
        cpu = torch.full((64, 64), 7.0)
        nn.init.normal_(cpu)
    assert random_fills == ["normal_"] and not torch.equal(cpu, torch.full((64, 64), 7.0))
