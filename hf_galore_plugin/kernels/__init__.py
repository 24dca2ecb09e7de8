"""Triton kernels and their launchers (the only GPU code, and the only modules that import triton).

Each launcher is the CUDA implementation of a `torch.ops.hf_galore` custom op; the op's CPU
implementation, its torch twin, lives beside the public function (`quant.functional`,
`optim.adamw8bit`) and is the kernel's test oracle."""
