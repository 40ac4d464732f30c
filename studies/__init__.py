"""The studies and benchmarks: what a fork may delete. The core (train, model, data, shards, checkpoints,
files, config, prepare, corpora, sample, export_hf) imports nothing from here. Run each from the repository
root as a module, e.g. python -m studies.ablate configs/ablate_cpu.toml."""
