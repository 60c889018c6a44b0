"""Measuring decoding, a layer above ``decode``: ``specdec bench`` (``bench``), its timing discipline
(``timing``), bandwidth roofline (``roofline``), report provenance and plots (``report``), and the
kernel and diffusion benches (``kernel_bench``, ``diffusion_bench``)."""
