"""Decoding: the engine's round loop and what it needs (``engine``), everything that proposes tokens
for it (``drafters``), masked-diffusion decoding (``diffusion``), the options of a decode in typed pieces
(``options``), and JSONL jobs (``jobs``). ``jobs`` sits on top: nothing else in ``decode`` imports it."""
