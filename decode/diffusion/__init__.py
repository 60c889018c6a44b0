"""Masked-diffusion decoding: the generator (``generator``), its canvas of blocks (``canvas``) and the
rules that choose which positions a step commits (``strategies``)."""
