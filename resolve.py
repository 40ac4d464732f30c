"""A run resolved once, then run: every setting final and everything that fixes one known, before anything
is trained, and before the run's folder holds anything but its lock file.

    plan = resolve(parse_config(argv))    # train.main; parse_config: defaults < TOML < --key=value, and on
    train(plan)                           # resume the checkpoint's settings; train never changes a setting

What fixes the rest, in this order: the processes (torchrun) and the device; a pretrained folder's shape
(init_from: a folder that is not a model's is refused before the run folder is made); the run folder, refused
now rather than after a long preparation (in use, or holding a run unasked); the checkpoint a resumed run
continues, checked against the settings; the prepared data (prepared first if needed; a prepared folder given as
the dataset fixes the data settings); the tokenizer and the start marker; the evaluation budget and the warmup;
the model's shape with its real vocabulary, checked to fit. Every refusal is one line (ConfigError, DataError).
The run's Session then holds the folder's lock for the run's lifetime, and refuses a checkpoint that another run
wrote after the plan read it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import tiktoken
import torch
import torch.distributed as dist

import shards
from config import BPE_SETTINGS_IN_META, SETTINGS_IN_META, Config, eval_token_budget, setting_problem, warmup_steps
from data import Flags
from errors import ConfigError, DataError
from model import GPT, GPTConfig
from run.checkpoint import check_resumable, read_checkpoint
from run.folder import hold
from run.processes import agree, setup_distributed

if TYPE_CHECKING:
    from huggingface import Pretrained


@dataclass(frozen=True)
class Plan:
    """What a run is, decided: `train(plan)` and its `Session` read it and change nothing of it."""

    cfg: Config  # the final settings, as config.json and the checkpoint record them
    model: GPTConfig  # the model's shape, with the rows of its real vocabulary
    rank: int
    world_size: int
    device: torch.device
    shard_path: Path  # the prepared folder the run trains on
    shards: shards.Shards  # its splits and meta.json
    tokenizer: tiktoken.Encoding  # with the start marker when the run has it
    bos_id: int | None
    resumed: dict | None = None  # the state of the checkpoint a resumed run continues
    start: Pretrained | None = None  # the weights of the folder a run from init_from starts with

    @property
    def processes(self) -> tuple[int, int, torch.device]:  # what the run's Session is for
        return self.rank, self.world_size, self.device


def resolve(cfg: Config) -> Plan:
    """The plan of a run of `cfg` (settings as cli.parse_config makes them), or one line why there is none."""
    rank, world_size, device = setup_distributed(cfg)
    try:
        return _resolve(cfg, rank, world_size, device)
    except BaseException:
        if dist.is_initialized():  # no Session will end the process group
            dist.destroy_process_group()
        raise


def _resolve(cfg: Config, rank: int, world_size: int, device: torch.device) -> Plan:
    say = print if rank == 0 else lambda *args, **kwargs: None
    start = None
    if cfg.init_from and not cfg.resume:  # a resumed run's weights are in its checkpoint (the folder may be gone)
        import huggingface  # only a run that starts from a folder needs it (and safetensors)

        start = huggingface.read_pretrained(Path(cfg.init_from))
        cfg = with_pretrained_shape(cfg, start, say)
    check_run_folder(cfg, rank)
    resumed = None
    if cfg.resume:
        path = Path(cfg.out_dir) / "ckpt.pt"
        resumed = read_checkpoint(path)
        check_resumable(path, resumed, cfg, world_size)
    guessed_vocab = (cfg.tokenizer_vocab_size if cfg.tokenizer == "bpe" else 256) + cfg.bos
    check_fits(model_settings(cfg, guessed_vocab), cfg.batch_size, device, cfg.grad_accum)  # before preparing
    if resumed is not None:  # a resumed run trains on the shards it started on, or not at all
        shard_path, prepared = shards.load_trained_on(path, resumed)
    else:
        shard_path, prepared, cfg = prepared_data(cfg, rank, say)
    budgets = dict(eval_tokens=evaluation_budget(cfg, resumed, world_size), warmup_iters=warmup_budget(cfg, resumed))
    cfg = dataclasses.replace(cfg, **budgets)
    enc = shards.load_tokenizer(shard_path)
    bos_id = shards.start_marker_id(enc) if cfg.bos else None
    tokenizer = shards.with_start_marker(enc, bos_id)
    model = model_settings(cfg, tokenizer.n_vocab)
    if resumed is not None:  # a run from a folder has the folder's rows, not a multiple of 64
        model = dataclasses.replace(model, vocab_size=resumed["model_config"]["vocab_size"])
    elif start is not None:
        model = dataclasses.replace(model, vocab_size=start.vocab_size(tokenizer))  # refuses another tokenizer
    check_fits(model, cfg.batch_size, device, cfg.grad_accum)
    return Plan(cfg, model, rank, world_size, device, shard_path, prepared, tokenizer, bos_id, resumed, start)


def warn_about(cfg: Config, say: Callable[..., None]) -> None:
    """Settings that run, but not as their author likely meant."""
    if cfg.packing == "pad" and cfg.flags != Flags():
        say("warning: with packing=pad each row holds one document, so the three flags change nothing", file=sys.stderr)
    if cfg.max_iters <= warmup_steps(cfg):
        say(
            f"warning: max_iters={cfg.max_iters} is not past warmup_iters={warmup_steps(cfg)}: the learning rate "
            "never reaches its peak or decays; give warmup_iters about a tenth of max_iters",
            file=sys.stderr,
        )


def check_run_folder(cfg: Config, rank: int) -> None:
    """Refuse now an out_dir that the run's Session would refuse (in use by another run, holding a run it would
    replace unasked, a resume without a checkpoint), before the data is prepared; the Session holds it then."""
    refused = None
    if rank == 0:  # only process 0 writes to out_dir
        try:
            with hold(Path(cfg.out_dir), cfg.resume, cfg.overwrite):
                pass
        except ConfigError as e:
            refused = e
    agree(refused)


def evaluation_budget(cfg: Config, resumed: dict | None, world_size: int) -> int:
    """eval_tokens, with -1 resolved once and kept in config.json and the checkpoint: a resumed run (whose
    max_iters or eval_interval may change) evaluates on the same documents."""
    if cfg.eval_tokens != -1:
        return cfg.eval_tokens
    saved = resumed["config"].get("eval_tokens", -1) if resumed is not None else -1
    return saved if saved >= 0 else eval_token_budget(cfg, world_size)


def warmup_budget(cfg: Config, resumed: dict | None) -> int:
    """warmup_iters, with -1 (a tenth of max_iters) resolved once, when the run starts, and kept in config.json
    and the checkpoint: a resumed run made longer re-times its cosine, never its warmup (resumed early, it would
    fall back into a longer one). A checkpoint that kept -1 warmed up for a tenth of the max_iters it kept."""
    if cfg.warmup_iters >= 0:
        return cfg.warmup_iters
    started = resumed["config"] if resumed is not None else {}
    if started.get("warmup_iters", -1) >= 0:
        return started["warmup_iters"]
    return warmup_steps(dataclasses.replace(cfg, max_iters=started.get("max_iters", cfg.max_iters)))


def model_settings(cfg: Config, vocab_size: int) -> GPTConfig:
    """The model of a run of `cfg` whose tokenizer has vocab_size ids: its rows rounded up to a multiple of 64
    (fast on GPU)."""
    names = ("seq_len", "n_layer", "n_head", "n_embd", "dropout", "bias", "gelu", "pos_emb")
    same = {name: getattr(cfg, name) for name in names}
    return GPTConfig(vocab_size=math.ceil(vocab_size / 64) * 64, attn_impl=cfg.attn_impl, **same)


def parameter_count(config: GPTConfig) -> int:
    """The model's own count, of a copy built on the meta device (no memory, whatever its size)."""
    with torch.device("meta"):
        return GPT(config).num_params()


def check_fits(config: GPTConfig, batch_size: int, device: torch.device, grad_accum: int = 1) -> None:
    """Refuse a model that cannot fit: weights, gradients and AdamW state (16 bytes a parameter), one fp32 copy
    of the logits, and a step's micro-batches (five int64 tensors each, all built before the step) are a lower
    bound on what training needs."""
    params = parameter_count(config)
    need = 16 * params + 4 * batch_size * config.seq_len * config.vocab_size
    need += 5 * 8 * grad_accum * batch_size * config.seq_len
    if device.type == "cuda":
        have = torch.cuda.get_device_properties(device).total_memory
    else:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(
            f"the model ({params / 1e6:,.1f}M parameters, {grad_accum} x {batch_size} x {config.seq_len} tokens a "
            f"step) needs about {need / 1e9:,.1f} GB to train on {device.type}; this machine has {have / 1e9:,.1f} GB"
        )


# ----------------------------------------------------------------------------------------------
# What a pretrained folder and a prepared folder fix


def with_pretrained_shape(cfg: Config, start: Pretrained, say: Callable[[str], None]) -> Config:
    """The folder's model settings made the run's (config.json records them); one given otherwise (not its
    default) contradicts the folder and is refused."""
    defaults, shape = Config(), {}
    for key, value in start.settings.items():
        if problem := setting_problem(key, value):  # a whole number can still be one no run takes (seq_len=1)
            raise ConfigError(f"init_from={start.folder}: its config.json makes {key}={value!r}, which {problem}")
        given = getattr(cfg, key)
        if given != value and given != getattr(defaults, key):
            raise ConfigError(
                f"{key}={given!r}, but init_from={start.folder} has {key}={value!r}: drop the setting to start "
                "from that folder"
            )
        shape[key] = value
    shown = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shape.items())
    say(f"init_from: starting from the weights in {start.folder}, which decide the model: {shown}")
    return dataclasses.replace(cfg, **shape)


def prepared_data(cfg: Config, rank: int, say: Callable[[str], None]) -> tuple[Path, shards.Shards, Config]:
    """The run's shard folder, loaded, and the settings it fixes: a prepared folder given as the dataset (whose
    data settings the run adopts), or the corpus prepared first: process 0 prepares, the others then find it.
    Preparation (prepare.py and corpora.py) is imported only then: training on a prepared folder needs neither."""
    if shards.is_prepared_folder(cfg.dataset):
        prepared = shards.load_shards(Path(cfg.dataset))
        return Path(cfg.dataset), prepared, with_prepared_settings(cfg, Path(cfg.dataset), prepared.meta, say)
    from prepare import prepare_for

    failed, shard_path = None, None
    if rank == 0:
        try:
            shard_path = prepare_for(cfg, log=say)
        except (ConfigError, DataError) as e:
            failed = e
    agree(failed)
    shard_path = shard_path or prepare_for(cfg, log=say)
    return shard_path, shards.load_shards(shard_path), cfg


def with_prepared_settings(cfg: Config, folder: Path, meta: dict, say: Callable[[str], None]) -> Config:
    """The data settings a prepared folder was made with made the run's, so that config.json records what the
    run used; a setting given otherwise (not its default) contradicts the data and is refused."""
    made, defaults, adopted = meta["settings"], Config(), {}
    same_tokenizer = cfg.tokenizer == meta["tokenizer"] or (  # a .tiktoken file is known by its content
        Path(cfg.tokenizer).is_file()
        and hashlib.sha256(Path(cfg.tokenizer).read_bytes()).hexdigest() == made["tokenizer"]
    )
    used = {
        "tokenizer": cfg.tokenizer if same_tokenizer else meta["tokenizer"],
        **{key: made.get(name, getattr(cfg, key)) for key, name in BPE_SETTINGS_IN_META.items()},
        **{key: made[name] for key, name in SETTINGS_IN_META.items()},
    }
    for key, value in used.items():
        if getattr(cfg, key) == value:
            continue
        if getattr(cfg, key) != getattr(defaults, key):
            raise ConfigError(
                f"{key}={getattr(cfg, key)!r}, but {folder} was prepared with {key}={value!r}: drop the setting to "
                "train on that folder, or give the corpus itself to prepare it with yours"
            )
        adopted[key] = value
    if adopted:
        shown = ", ".join(f"{key}={value!r}" for key, value in adopted.items())
        say(f"data: {folder} was prepared with {shown}; the run uses (and records) those")
    return dataclasses.replace(cfg, **adopted)
