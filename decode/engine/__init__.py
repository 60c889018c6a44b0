"""The one decode loop (``loop.SpecEngine``: prefill -> (propose -> verify -> accept)*), and what it runs
on: key/value caches (``cache``), verification (``verify``), requests and results (``types``), compiled
steps (``compiled``), prefixes held once (``hydragen``), a draft's lean forward (``lean``), the draft
length chosen from measured costs (``length``), prompts that ride the verify forwards (``ride``) and
PEARL's split verification (``split``). It knows drafters only through ``decode.drafters.base``."""
