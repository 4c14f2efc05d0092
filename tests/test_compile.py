"""The torch settings compiled steps run under (flexsgl/compile.py)."""

import torch

from flexsgl import compile as flex_compile


def test_settings_turn_on_inductor_pdl_only_inside_and_only_when_allowed(monkeypatch):
    triton = torch._inductor.config.triton
    with torch._inductor.config.patch({"triton.enable_pdl": False}):  # the config's own save and restore
        for env, inside in (("1", True), ("0", False)):
            monkeypatch.setenv("FLEXSGL_PDL", env)
            with flex_compile.settings():
                assert triton.enable_pdl is inside
            assert triton.enable_pdl is False
