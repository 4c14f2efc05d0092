"""Start-up does no work its run does not use: a model built for loading runs no initialiser (its
values come from the checkpoint alone), dummy weights are drawn straight into the parameters, a
CPU KV pool is not written until it is used, and `generate` imports no package it does not run;
its start-up line names where the time went."""

import json
import os
import random
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from flexsgl.cache.latent_pool import LatentKVPool
from flexsgl.cache.pool import KVPool
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


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the process's resident memory from /proc")
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_a_cpu_kv_pool_is_zero_and_costs_memory_only_where_written(kind):
    """A CPU pool of 1 GiB reads zero everywhere, yet adds almost nothing to the process's resident
    memory until pages are written (torch.zeros would have written all of it); what is written
    reads back."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    layers, page_size = 4, 64
    if kind == "gqa":
        heads, dim = 8, 128
        pages = (1 << 30) // (2 * layers * page_size * heads * dim * 4)
        before = resident_bytes()
        pool = KVPool(layers, pages, page_size, heads, dim, torch.float32, CPU)
        tensors = pool.k + pool.v
    else:
        mla = SimpleNamespace(kv_lora_rank=448, qk_rope_head_dim=64, qk_nope_head_dim=128, latent_dim=512,
                              softmax_scale=0.1)
        pages = (1 << 30) // (layers * page_size * mla.latent_dim * 4)
        before = resident_bytes()
        pool = LatentKVPool(layers, pages, page_size, mla, torch.float32, CPU)
        tensors = pool.kv
    size = sum(t.numel() * t.element_size() for t in tensors)
    assert size >= 1 << 29
    assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 and t.dtype == torch.float32 for t in tensors)
    assert all(torch.count_nonzero(t) == 0 for t in tensors)
    assert resident_bytes() - before < size // 8, f"seed={seed}"
    slot = int(torch.randint(page_size, pages * page_size, (), generator=gen))
    value = torch.randn(tensors[1].shape[1:], generator=gen)
    tensors[1][slot] = value
    assert torch.equal(tensors[1][slot], value) and torch.count_nonzero(tensors[0]) == 0, f"seed={seed}"


def test_dummy_weights_are_drawn_into_the_parameters(monkeypatch):
    """Dummy weights fill each parameter with the values of the documented scheme (block c of
    parameter i of rows of about BLOCK_ELEMENTS elements from a generator seeded from (seed, i, c):
    N(0, 0.02), a norm's weight 1 + 0.1 N(0, 1)), recomputed here; whole blocks are drawn straight
    into the parameter (no block drawn apart and copied), but for the norms'."""
    import flexsgl.model.dummy_weights as dummy

    seed = random.randrange(2**20)
    monkeypatch.setattr(dummy, "BLOCK_ELEMENTS", 1 << 12)  # several blocks per matrix, the last one short
    apart = []
    real_block = dummy.DummyTensor.block
    monkeypatch.setattr(dummy.DummyTensor, "block", lambda self, *a: (apart.append(self.norm), real_block(self, *a))[1])
    model = build_model(resolve("tiny", "dummy"), CPU, torch.float32, seed)
    assert apart and all(apart), "only the norms' blocks are drawn apart"
    for i, (name, p) in enumerate(model.named_parameters()):
        key, width = seed * 1000003 + i, p[0].numel()
        rows = max(1, (1 << 12) // width)
        blocks = []
        for c in range(-(-p.shape[0] // rows)):
            g = torch.Generator().manual_seed((key * 1000033 + c) % (1 << 63))
            shape = (min(rows, p.shape[0] - c * rows),) + tuple(p.shape[1:])
            blocks.append(1.0 + 0.1 * torch.randn(shape, generator=g) if name.endswith("norm.weight")
                          else torch.empty(shape).normal_(0.0, 0.02, generator=g))
        assert torch.equal(p, torch.cat(blocks)), f"{name} seed={seed}"


GENERATE = """
import json, sys
from flexsgl.cli import app
try:
    app(["generate", "Return the", "--device", "cpu", "--max-new-tokens", "4"])
except SystemExit as e:
    assert not e.code, e.code
print(json.dumps({m: m in sys.modules for m in ("torch._dynamo", "transformers", "xgrammar", "fastapi")}))
"""


def test_generate_on_the_embedded_model_imports_only_what_it_runs_and_names_its_start_up():
    """`flexsgl generate` on the CPU (eager) with the embedded model imports neither torch._dynamo
    nor transformers (its tokenizer.json is read by the tokenizers library), nor the server's or
    structured outputs' packages; its start-up line names phases that add up to its total (each
    shown to a tenth of a second), and the first token comes after it."""
    out = subprocess.run([sys.executable, "-c", GENERATE], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FLEXSGL_LOG_LEVEL": "info"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == {"torch._dynamo": False, "transformers": False,
                                                        "xgrammar": False, "fastapi": False}, out.stdout
    ready = re.search(r"ready in ([\d.]+)s after start \((.*)\)", out.stderr)
    assert ready, out.stderr
    phases = dict((name.strip(), float(s)) for name, s in re.findall(r"([A-Za-z ]+) ([\d.]+)s", ready.group(2)))
    assert set(phases) == {"imports", "resolving", "weights", "tokenizer", "KV pool", "other"}, phases
    assert abs(sum(phases.values()) - float(ready.group(1))) <= 0.05 * (len(phases) + 1), ready.group(0)
    first = re.search(r"first token ([\d.]+)s after start", out.stderr)
    assert first and float(first.group(1)) >= float(ready.group(1)), out.stderr
