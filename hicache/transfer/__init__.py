"""Moving page bytes between the GPU pool and the host tier: the copy paths (`kernels`: CPU,
CUDA, staging) and the completions that tell the engine when copies are done (`completions`)."""
