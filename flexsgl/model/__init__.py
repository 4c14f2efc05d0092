"""Plain-PyTorch models (flexsgl.model.config.ARCHITECTURES lists them), their configs, presets and loader."""
