"""The shared layer under ``decode/`` and ``train/``: errors, artifacts, model loading and placement,
architecture adapters, and every nn.Module an artifact holds."""
