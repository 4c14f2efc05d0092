"""Every backend the registry names implements the attention backend interface (AttentionBackend,
flexsgl/attention/base.py), and the decode router forwards every hook of it.

Each SPECS entry is checked for each attention kind it serves (GQA, and MLA where its MLA class
differs): its module is imported and its class checked without building it (a subclass of
AttentionBackend with no abstract hook left, its declared name, capabilities of the right types,
the static declarations answering, and `forward_expanded` defined wherever `expands_latents` is).
Every module imports on the CPU, since each backend imports its kernel package only when it is
built or run. A backend whose package is installed is then built over a small CPU pool, as
PhaseRouter builds it; one whose package (sgl_kernel, flashinfer) is missing is checked at class
level only.
"""

import importlib.util
import inspect

import pytest
import torch

from flexsgl.attention.base import AttentionBackend
from flexsgl.attention.registry import SPECS, Choice, backend_class
from flexsgl.attention.router import DecodeBySize, PhaseRouter
from flexsgl.cache.pool import build_kv_pool
from flexsgl.model.config import ModelConfig
from flexsgl.model.presets import PRESETS

CPU = torch.device("cpu")
MODELS = {"gqa": ModelConfig.from_hf(PRESETS["tiny"]["config"]),
          "mla": ModelConfig.from_hf(PRESETS["deepseek-v2-lite"]["config"])}
TARGETS = [(name, kind) for name, spec in SPECS.items() for kind in spec.attention]
# The hooks a built backend answers (the static declarations are asked of the class).
HOOKS = [name for name, member in vars(AttentionBackend).items()
         if not name.startswith("_") and inspect.isfunction(member)]


def small_pool(kind: str):
    return build_kv_pool(MODELS[kind], 8, 16, torch.float32, CPU)


def test_the_interface_declares_every_hook_the_engine_calls():
    assert set(HOOKS) == {"prepare", "forward", "init_graph_state", "bind_graph", "fill_graph", "graph_step",
                          "expands_latents", "forward_expanded"}
    assert AttentionBackend.__abstractmethods__ == {"prepare", "forward", "init_graph_state", "bind_graph",
                                                    "fill_graph"}


@pytest.mark.parametrize("name,kind", TARGETS, ids=[f"{n}-{k}" for n, k in TARGETS])
def test_every_registered_backend_class_implements_the_interface(name, kind):
    spec = SPECS[name]
    cls = backend_class(spec, kind)
    assert issubclass(cls, AttentionBackend), f"{cls.__qualname__} does not inherit AttentionBackend"
    assert not inspect.isabstract(cls), f"{cls.__qualname__} leaves {sorted(cls.__abstractmethods__)} abstract"
    assert isinstance(cls.name, str) and backend_class(SPECS[cls.name], kind) is cls, \
        f"{cls.__qualname__}.name {cls.name!r} names another backend"
    assert isinstance(cls.graphable, bool) and isinstance(cls.compiles_per_shape, bool)
    why = cls.unsupported(16, CPU)
    assert why is None or (isinstance(why, str) and why)
    scratch = cls.prefill_scratch_bytes(MODELS[kind], 256, 2)
    assert isinstance(scratch, int) and scratch >= 0
    if cls.expands_latents is not AttentionBackend.expands_latents:
        assert cls.forward_expanded is not AttentionBackend.forward_expanded, \
            f"{cls.__qualname__} may expand the latents but has no forward_expanded"


@pytest.mark.parametrize("name,kind", TARGETS, ids=[f"{n}-{k}" for n, k in TARGETS])
def test_every_registered_backend_builds_as_an_attention_backend(name, kind):
    spec = SPECS[name]
    if spec.package and importlib.util.find_spec(spec.package) is None:
        pytest.skip(f"{spec.package} is not installed: {name} is checked at class level only")
    pool = small_pool(kind)
    backend = backend_class(spec, kind)(pool, num_heads=MODELS[kind].num_heads, compiled=False)
    assert isinstance(backend, AttentionBackend)
    for hook in HOOKS:
        assert callable(getattr(backend, hook))


class Batch:
    def __init__(self, batch_size: int):
        self.batch_size, self.mode = batch_size, "decode"


def spy_backend(label: str) -> AttentionBackend:
    """A backend whose every hook records its arguments and returns (label, hook)."""

    def hook(name):
        def call(self, *args):
            self.calls.append((name, args))
            return label, name
        return call

    def init(self):
        self.name, self.calls = label, []

    return type(f"Spy{label}", (AttentionBackend,), {"__init__": init, **{h: hook(h) for h in HOOKS}})()


def test_decode_by_size_forwards_every_hook_to_the_owner_of_the_batch_size():
    """Each hook of the interface is defined by DecodeBySize itself (not a default it inherits) and
    reaches the backend that owns the batch size with the same arguments; a hook without a batch
    size (init_graph_state) reaches both, the small one for the sizes it takes."""
    max_small = 4
    for hook in HOOKS:
        assert hook in vars(DecodeBySize), f"DecodeBySize takes {hook} from the base class instead of forwarding it"
        params = list(inspect.signature(getattr(AttentionBackend, hook)).parameters)[1:]
        for bs in (max_small, max_small + 1):
            small, large = spy_backend("small"), spy_backend("large")
            router = DecodeBySize(small, max_small, large)
            values = {"fb": Batch(bs), "bs": bs, "max_bs": 8, "max_pages": 3}
            args = tuple(values.get(p, object()) for p in params)
            result = getattr(router, hook)(*args)
            if "fb" in params or "bs" in params:
                owner, other = (small, large) if bs <= max_small else (large, small)
                assert owner.calls == [(hook, args)] and other.calls == [], hook
                assert result == (owner.name, hook), hook
            else:
                assert small.calls == [(hook, (max_small, 3))] and large.calls == [(hook, (8, 3))], hook


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_phase_router_hands_out_attention_backends(kind):
    flex = SPECS["flex"]
    router = PhaseRouter(Choice(flex, flex, flex, 2), small_pool(kind), MODELS[kind].num_heads, compiled=False)
    assert isinstance(router.decode, DecodeBySize)
    for mode in ("prefill", "decode"):
        fb = Batch(1)
        fb.mode = mode
        assert isinstance(router.for_batch(fb), AttentionBackend)
