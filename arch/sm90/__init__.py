"""Hopper (SM90) kernels: the forward attention kernel and its tuning table."""
