"""Blackwell (SM100) kernels: none yet.

The host layer reports SM100 devices as unserved (reference fallback only on request). The
SM100 forward (tcgen05, TMEM) belongs here; compile it for sm_100a on the CPU in CI.
"""
