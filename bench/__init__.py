"""Benchmarks: attention and the training step (attention), data preparation (preparation), packing
(packing); gpu.sh runs the GPU speed check in one call."""
