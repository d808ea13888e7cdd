"""Arch-neutral CuTe-DSL device helpers shared by the SM90 and SM100 kernels."""
