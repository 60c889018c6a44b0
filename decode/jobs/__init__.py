"""Decode jobs: options (``decode.options``) checked in one place before any model loads (``validate``), the
engine built from them (``build``), JSONL records in and out (``io``), the job runner (``job``) and the
memory model that fits a batch into a budget (``memory``)."""
