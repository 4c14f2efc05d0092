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
    ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "'bitsandbytes'"),
    ({"load_in_8bit": True}, "'bitsandbytes'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {},
      "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}}, "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}}, "no weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                           "symmetric": False}}}}, "asymmetrically"),
], ids=["awq", "gptq", "bitsandbytes", "mxfp4", "unknown", "no-method", "ct-packed", "ct-fp4", "ct-int8", "fp8-e5m2",
        "fp8-bad-block", "bnb-4bit-no-method", "bnb-8bit-no-method", "ct-int8-kv", "ct-nothing", "ct-asymmetric"])
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


CT_CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}


@pytest.mark.parametrize("config", [
    {**BASE, "quantization_config": {**CT_CHANNEL, "format": "naive-quantized"}},
    {**BASE, "compression_config": CT_CHANNEL},
], ids=["naive-quantized", "compression_config"])
def test_older_compressed_tensors_fp8_configs_are_read_as_float_quantized(config):
    s = ModelConfig.from_hf(config, "Config file 'x/config.json'").quant
    assert (s.method, s.strategy, s.scale_name("a.weight")) == ("compressed-tensors", "channel", "a.weight_scale")


@pytest.mark.parametrize("groups", [{}, {"group_0": {"targets": []}}])
def test_a_kv_cache_scheme_alone_quantizes_no_weights(groups):
    assert config({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": groups,
                   "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}).quant is None


def test_stacked_experts_scales_lead_with_the_experts():
    block = config({"quant_method": "fp8", "weight_block_size": [16, 32]}).quant
    assert block.scale_shape((6, 64, 40)) == (6, 4, 2)
    for strategy, shape in (("channel", (6, 64, 1)), ("tensor", (6, 1))):
        q = {**CT_CHANNEL, "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": strategy}}}}
        assert config(q).quant.scale_shape((6, 64, 40)) == shape


def test_an_autogptq_checkpoint_is_refused_naming_gptq(tmp_path):
    """An AutoGPTQ checkpoint: its quantization in quantize_config.json beside a config.json without any."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": False}))
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_dir(tmp_path)
    msg = str(e.value)
    assert "GPTQ" in msg and "quantize_config.json" in msg and "\n" not in msg and msg.endswith("."), msg
