"""Triton kernels (the only GPU code). Each kernel module pairs every launcher with a torch
twin of the same signature; the twin is the CPU path and the test oracle."""
