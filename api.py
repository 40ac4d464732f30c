"""The core's public entry point for the studies and benchmarks (studies/, bench/): train a run, lay rows out
by hand and score them, and the settings a run resolves. They use these and no other part of train.py, whose
internals are free to change."""

from __future__ import annotations

import numpy as np
import torch

import train
from config import Config, eval_token_budget, warmup_steps
from data import Batch, Flags, make_batch
from model import GPT, GPTConfig

__all__ = ["batch_of_rows", "fresh_model", "losses", "parameter_count", "precision", "resolved", "run", "training_step"]


def run(cfg: Config) -> dict:
    """Train as configured (resuming with cfg.resume); returns the last evaluation. A stop signal ends it with
    errors.Stopped, its checkpoint saved."""
    return train.train(cfg)


def precision(device: torch.device, dtype: str = "auto"):
    """The run's compute precision as a context: bfloat16 autocast on CUDA (dtype auto), float32 elsewhere."""
    return train.autocast(device, dtype)


def losses(model: torch.nn.Module, batch: Batch, config: GPTConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The training loss of each token (B, T), 0 where the target does not count, and which targets count;
    `config`: the model's settings where `model` is a compiled or wrapped GPT."""
    return train.token_losses(model, batch, config or model.config)


def batch_of_rows(rows: list[np.ndarray], seq_len: int, eot_id: int, flags: Flags = Flags()) -> Batch:
    """A batch whose row r holds the tokens rows[r] (at most seq_len + 1), padded: rows laid out by hand."""
    if any(len(row) > seq_len + 1 for row in rows):
        raise ValueError(f"a row holds at most seq_len + 1 = {seq_len + 1} tokens")
    tokens = np.full((len(rows), seq_len + 1), eot_id, dtype=np.int64)
    for r, row in enumerate(rows):
        tokens[r, : len(row)] = row
    return make_batch(tokens, np.array([len(row) for row in rows]), eot_id, flags=flags)


def parameter_count(cfg: Config, vocab_size: int) -> int:
    """The parameters of the model a run of `cfg` trains, with a tokenizer of vocab_size ids."""
    return GPT(train.model_settings(cfg, vocab_size)).num_params()


def resolved(cfg: Config) -> tuple[int, int]:
    """(warmup steps, validation tokens) a run of `cfg` on one process uses where they are left automatic."""
    return warmup_steps(cfg), eval_token_budget(cfg)


def fresh_model(cfg: Config, vocab_size: int) -> tuple[GPT, torch.optim.Optimizer]:
    """The model and optimizer a run of `cfg` starts from (the seed's init), on the CPU."""
    torch.manual_seed(cfg.seed)
    model = GPT(train.model_settings(cfg, vocab_size))
    return model, train.optimizer_for(model, cfg)


def training_step(model: torch.nn.Module, optimizer, batch: Batch, precision, config: GPTConfig) -> float:
    """One step of train.py's loss and AdamW at the optimizer's learning rate; returns the loss."""
    loss = train.accumulate_gradients(model, [batch], precision, config)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()
