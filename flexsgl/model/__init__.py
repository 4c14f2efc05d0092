"""Plain-PyTorch models (flexsgl.model.architectures.ARCHITECTURES lists them), their configs,
presets and loader."""
