"""Everything that proposes tokens for the engine to verify, one module per family, all built on the
contract in ``base`` (``Drafter``, ``Proposal``, ``Segment``); ``registry`` maps a drafter spec to the
factory that builds it and the options that factory takes."""
