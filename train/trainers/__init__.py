"""One module per kind of artifact specdec trains, each a trainer over the shared loop (``train.loop``)
with data from ``train.data`` and teacher features from ``train.teacher``: draft models (``draft``),
heads on the target (``heads``: Medusa, Clover, Chimera, EAGLE / EAGLE-3, PPD, hidden transfer),
SpecDec++ acceptance heads (``acceptance``, with its labels and stop policies), Lexical Unit Decoding
(``lud``), block-diffusion LMs and their Learn2PD filters (``dllm``, ``filter``), and a recipe family's
own tokenizer and target (``lm``)."""
