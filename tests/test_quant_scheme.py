"""A config's quantization_config: the FP8 formats flexsgl serves are read into a QuantScheme, every
other is refused at config time in one sentence that names it."""

import pytest

from flexsgl.errors import CheckpointError
from flexsgl.model.config import ModelConfig

BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def config(q) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, "quantization_config": q}, "Config file 'x/config.json'")


def refusal(q) -> str:
    with pytest.raises(CheckpointError) as e:
        config(q)
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0, msg
    assert "config.json" in msg, msg
    return msg


@pytest.mark.parametrize("q, named", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "'awq'"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    ({"quant_method": "mxfp4"}, "'mxfp4'"),
    ({"quant_method": "some-new-format"}, "'some-new-format'"),
    ({"bits": 4}, "None"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "group"}}}}, "4-bit"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "'int'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
], ids=["awq", "gptq", "bitsandbytes", "mxfp4", "unknown", "no-method", "ct-packed", "ct-fp4", "ct-int8", "fp8-e5m2",
        "fp8-bad-block"])
def test_unserved_quantization_is_refused_naming_the_format(q, named):
    msg = refusal(q)
    assert named in msg, msg


def test_block_wise_fp8_is_read_with_its_block_and_ignored_modules():
    s = config({"quant_method": "fp8", "weight_block_size": [128, 64], "activation_scheme": "dynamic",
                "fmt": "e4m3", "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.down_proj"]}).quant
    assert (s.strategy, s.block, s.scale_name("a.weight")) == ("block", (128, 64), "a.weight_scale_inv")
    assert s.scale_shape((160, 130)) == (2, 3)
    assert s.ignores("lm_head") and s.ignores("model.layers.1.mlp.down_proj")
    assert not s.ignores("model.layers.0.mlp.down_proj")


@pytest.mark.parametrize("strategy, shape", [("channel", (160, 1)), ("tensor", (1,))])
def test_compressed_tensors_fp8_is_read_with_its_strategy(strategy, shape):
    s = config({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head", "re:.*mlp\\.gate$"]}).quant
    assert (s.strategy, s.scale_name("a.weight"), s.scale_shape((160, 64))) == (strategy, "a.weight_scale", shape)
    assert s.ignores("lm_head") and s.ignores("model.layers.3.mlp.gate") and not s.ignores("model.layers.3.mlp.up")
