"""One forward step on the device: model runner, CUDA graphs, sampler, device choice."""
