"""CuTe-DSL kernels of cute_attn, torch-free, by architecture.

Installed as `cute_attn.arch` (pyproject package-dir); never imported as a top-level `arch`.
`common/` holds arch-neutral device helpers (accumulator layouts, online softmax, masks),
`sm90/` the Hopper kernels with their tuning table, `sm100/` the Blackwell kernels (none yet).
"""
