"""specdec: lossless speculative decoding and parallel diffusion decoding for offline batch work."""

__version__ = "0.1.0"
