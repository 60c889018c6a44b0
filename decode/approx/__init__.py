"""Approximate decode modes: each trades some fidelity to the target's own decoding for speed or for
several outputs at once, on a loop of its own (``decode.engine.own``), and labels every record it
writes ``"approximate": true``. The registry (``decode.drafters.registry``) builds them: through each
module's ``build(spec_or_artifact, target, tokenizer, options)`` and ``check_spec(spec)``, or for EAD,
whose spec names a draft model, with the draft loaded and checked as draft models are.

- ``superposed``: Superposed Decoding, k drafts from one forward per step;
- ``ead``: Entropy Adaptive Decoding, a draft model that hands over to the target while it is unsure;
- ``lud``: Lexical Unit Decoding, several tokens a step from a target fine-tuned on placeholders;
- ``skipdecode``: SkipDecode, later positions bypass more of the lower layers, batch-wide.
"""
