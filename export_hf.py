"""Export a run to a Hugging Face model folder, checked logit for logit.

    python export_hf.py --out_dir=out --to=hf/quickstart           # then, offline:
    AutoModelForCausalLM.from_pretrained("hf/quickstart"), AutoTokenizer.from_pretrained("hf/quickstart")

The architecture maps exactly: learned positions as GPT-2, RoPE as a GPT-NeoX block, the tokenizer as a
`tokenizers` byte-level BPE (huggingface.py says how, table by table); like the run's encoding, the tokenizer
reads a literal "<|endoftext|>" in text as text.

The folder holds config.json, model.safetensors, the tokenizer files and a model card (README.md) with the
run's flags, data and final val_doc_loss. After writing, the export is checked: the Hugging Face model's
fp32 logits against this repo's on random token sequences, and the tokenizer's ids against the run's on
validation documents; the folder is kept only if both agree.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch

import huggingface
import sample
from cli import run_main, script_settings
from config import Config, setting
from errors import ConfigError, DataError, ExportError
from model import GPT
from run.checkpoint import read_checkpoint
from shards import BOS_TEXT, EOT_TEXT, document_bounds, document_opening, load_shards

LOGIT_TOLERANCE = 1e-4  # max |difference| of fp32 logits that the check accepts


# ----------------------------------------------------------------------------------------------
# The export and its check


def model_card(state: dict, out_dir: Path, config: dict) -> str:
    cfg = Config(**state["config"])
    final = state.get("evaluation")  # from the checkpoint itself: the same snapshot as the weights
    loss = f"{final['val_doc_loss']:.4f} at step {final['step']}" if final else "not recorded in the checkpoint"
    return "\n".join(
        [
            f"# {out_dir.name}: a {config['model_type']} model trained with packed-gpt",
            "",
            f"- architecture: {config['architectures'][0]} ({cfg.n_layer} layers, {cfg.n_embd} wide, "
            f"{cfg.n_head} heads, context {cfg.seq_len}, positions {cfg.pos_emb})",
            f"- trained: {state['step']} steps of {cfg.batch_size * cfg.grad_accum} x {cfg.seq_len} tokens, "
            f"packing={cfg.packing}, bos={cfg.bos}, doc_mask={cfg.doc_mask}, "
            f"reset_position_ids={cfg.reset_position_ids}, mask_boundary_loss={cfg.mask_boundary_loss}, "
            f"seed {cfg.seed}",
            f"- data: {cfg.dataset}, tokenizer {state['tokenizer']['name']} ({cfg.tokenizer})",
            f"- final val_doc_loss (every validation document alone, nats per token): {loss}",
            "",
            "Each input is one document from position 0, as the model was evaluated"
            + (
                ", after the start marker `<|bos|>` (the tokenizer's `bos_token`), which lm-evaluation-harness puts "
                "in front of each document itself; the tokenizer adds it only when loaded with add_bos_token=True."
                if cfg.bos
                else ", with nothing before it: the model was trained without a start marker (lm-evaluation-harness "
                "puts the EOT in front of a document, a start the run's evaluation never used)."
            )
            + " The document mask of packed training rows is not part of this format: give one document per "
            "sequence. The tokenizer reads a literal `<|endoftext|>` or `<|bos|>` in text as text; the "
            "end-of-text token is its `eos_token`.",
            "",
        ]
    )


def export(out_dir: Path, to: Path, overwrite: bool = False) -> dict:
    """Write the Hugging Face folder `to` for the run in `out_dir`, check it, and return the check's figures."""
    state = read_checkpoint(out_dir / "ckpt.pt")
    pos_emb = state["model_config"].get("pos_emb")
    if pos_emb not in huggingface.TO_HF:
        raise ExportError(f"{out_dir}: a model with pos_emb={pos_emb!r} has no Hugging Face mapping here")
    target, run, here = to.resolve(), out_dir.resolve(), Path.cwd().resolve()
    if target in (run, here) or run.is_relative_to(target) or here.is_relative_to(target) or target == target.parent:
        raise ExportError(
            f"--to={to} is the run's folder, the working folder or a folder above them: give a new folder"
        )
    if to.exists() and not overwrite:
        raise ExportError(f"{to} exists: give another --to, or --overwrite=true to replace it")
    if to.exists() and not ((to / "config.json").is_file() and (to / "model.safetensors").is_file()):
        raise ExportError(f"{to} exists and is not an exported model folder: --overwrite=true replaces only those")
    model = sample.trained_model(state, torch.device("cpu"), attn_impl="sdpa").float()
    enc = sample.checkpoint_tokenizer(state)
    tmp = to.with_name(f".{to.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        config = huggingface.write_folder(tmp, model, enc)
        (tmp / "README.md").write_text(model_card(state, out_dir, config))
        checked = check(tmp, model, enc, state)
        if to.exists():
            if foreign := sorted({p.name for p in to.iterdir()} - {p.name for p in tmp.iterdir()}):
                raise ExportError(
                    f"{to} holds {', '.join(foreign)}, which an export does not write: --overwrite=true replaces "
                    "only an earlier export (move those, or give another --to)"
                )
            shutil.rmtree(to)
        tmp.rename(to)
    except ImportError as e:
        raise ExportError(f"the export needs {e.name}: pip install -r requirements.txt") from None
    except OSError as e:
        raise ExportError(f"could not write {to} ({e.strerror or e})") from None
    except Exception as e:  # safetensors and tokenizers report a failed write in exceptions of their own
        if isinstance(e, ExportError) or (reason := os_error_words(e)) is None:
            raise
        raise ExportError(f"could not write {to} ({reason})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return checked


def os_error_words(error: Exception) -> str | None:
    """The OS's words for a failed write that a writer in Rust (safetensors, tokenizers) raises as its own
    exception, whose text ends "(os error 28)"; None for any other error."""
    found = re.search(r"\(os error (\d+)\)", str(error))
    return os.strerror(int(found[1])) if found else None


def check(folder: Path, model: GPT, enc: tiktoken.Encoding, state: dict, lengths=(1, 17, None)) -> dict:
    """The exported folder reproduces the run: fp32 logits on random sequences (of these lengths, None:
    seq_len) within LOGIT_TOLERANCE, and the tokenizer's ids equal the run's on validation documents: the
    text's alone by default, the document's opening (the BOS first, under the marker) with add_bos_token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()  # documents longer than the context are encoded here on purpose
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        marker = BOS_TEXT in enc.special_tokens_set  # then `generate` wants it first, as the run sampled
        opening_tokenizer = AutoTokenizer.from_pretrained(folder, add_bos_token=True) if marker else tokenizer
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # what transformers raises for a folder it cannot load
        raise ExportError(
            f"transformers cannot load the exported folder ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for length in lengths:
        T = min(length or model.config.seq_len, model.config.seq_len)  # any seq_len train.py accepts, even 2
        ids = torch.randint(0, enc.n_vocab, (2, T), generator=generator)
        with torch.no_grad():
            ours = model(ids, torch.arange(T).expand(2, T), None)
            theirs = hf(input_ids=ids).logits
        worst = max(worst, float((ours - theirs).abs().max()))
    if worst > LOGIT_TOLERANCE:
        raise ExportError(f"the exported model's logits differ from the run's by up to {worst:.2e}")
    texts = validation_texts(state, enc)
    for text in texts:
        plain, opening = enc.encode_ordinary(text), document_opening(enc, text)
        if tokenizer(text)["input_ids"] != plain or opening_tokenizer(text)["input_ids"] != opening:
            raise ExportError(f"the exported tokenizer encodes {text[:60]!r} differently from the run")
    return {"max_abs_logit_difference": worst, "tokenizer_texts": len(texts)}


def validation_texts(state: dict, enc: tiktoken.Encoding, n: int = 64) -> list[str]:
    """Up to n validation documents of the run (when its shards are still there), and texts that
    tokenizers get wrong first: unicode, runs of whitespace, the literal end-of-text text."""
    texts = [
        "def f(x):\n    return x  # ünïcödé, 日本語, emoji 🙂\n\n\n\t\t  trailing   ",
        f"a literal {EOT_TEXT} inside a document, twice{EOT_TEXT}, and a literal {BOS_TEXT} too",
        "  leading spaces, CRLF\r\n and numbers 1234567 3.14159",
    ]
    try:
        shards = load_shards(Path(state["shards"]))
    except (DataError, OSError, KeyError):
        return texts
    val = shards.val[: min(len(shards.val), 200_000)]
    starts, ends = document_bounds(val, shards.eot_id)
    return texts + [enc.decode(val[s : e - 1].tolist()) for s, e in list(zip(starts, ends))[:n]]


@dataclass
class ExportSettings:
    out_dir: str = setting("out", "the run's folder (holds ckpt.pt)", path=True)
    to: str = setting("", "the Hugging Face folder to write (required)", path=True)
    overwrite: bool = setting(False, "replace --to if it is an earlier export")


def main(argv: list[str]) -> int:
    args = script_settings(ExportSettings, argv, __doc__, "python export_hf.py")
    if not args.to.strip():
        print("error: give the folder to write as --to=FOLDER", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        checked = export(Path(args.out_dir), Path(args.to), args.overwrite)
    except (ConfigError, DataError, ExportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in Path(args.to).iterdir())
    print(
        f"wrote {args.to} ({size / 1e6:.1f} MB) in {time.time() - t0:.1f}s; checked: fp32 logits within "
        f"{checked['max_abs_logit_difference']:.1e} of the run's, the same token ids on "
        f"{checked['tokenizer_texts']} texts"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
