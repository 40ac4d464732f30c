"""Export a run to a Hugging Face model folder, checked logit for logit.

    python export_hf.py --out_dir=out --to=hf/quickstart           # then, offline:
    AutoModelForCausalLM.from_pretrained("hf/quickstart"), AutoTokenizer.from_pretrained("hf/quickstart")

The architecture maps exactly. With learned positions it is GPT-2's (pre-LayerNorm, exact GELU, tied
embeddings; GPT-2's biases, which this model has none of by default, are written as zeros; a model with biases
and tanh GELU, as a run started from GPT-2's weights, writes its own). With RoPE it is a
GPT-NeoX block (LayerNorm, exact GELU, rotary over the whole head with the half-split pairing, sequential
residual). The tokenizer becomes a `tokenizers` byte-level BPE with the run's split pattern and merges,
EOT as the end-of-text token; like the run's encoding, it reads a literal "<|endoftext|>" in text as text.

The folder holds config.json, model.safetensors, the tokenizer files and a model card (README.md) with the
run's flags, data and final val_doc_loss. After writing, the export is checked: the Hugging Face model's
fp32 logits against this repo's on random token sequences, and the tokenizer's ids against the run's on
validation documents; the folder is kept only if both agree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch

import sample
from cli import run_main, script_settings
from config import Config, setting
from errors import ConfigError, DataError, ExportError
from model import GPT
from run.checkpoint import read_checkpoint
from shards import BOS_TEXT, EOT_TEXT, document_bounds, document_opening, load_shards

LOGIT_TOLERANCE = 1e-4  # max |difference| of fp32 logits that the check accepts


# ----------------------------------------------------------------------------------------------
# Weights


LINEARS = (  # GPT-2's projections of a block, and this model's
    ("attn.c_attn", "attn.qkv"),
    ("attn.c_proj", "attn.proj"),
    ("mlp.c_fc", "mlp.fc"),
    ("mlp.c_proj", "mlp.proj"),
)


def bias_of(sd: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """A projection's bias: zeros where the model has none (GPT-2's format has a place for it)."""
    return sd.get(f"{layer}.bias", torch.zeros(len(sd[f"{layer}.weight"])))


def gpt2_weights(model: GPT) -> tuple[dict, dict[str, torch.Tensor]]:
    """GPT-2's config and state dict for a learned-position model. GPT-2's Conv1D layers keep their
    weights as (in, out): this model's Linear weights, transposed."""
    c, sd = model.config, model.state_dict()
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.seq_len,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": 4 * c.n_embd,
        "activation_function": "gelu_new" if c.gelu == "tanh" else "gelu",  # exact unless started from GPT-2
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
    }
    weights = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"]}
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            weights[f"{theirs}{norm}.weight"] = sd[f"{ours}{norm}.weight"]
            weights[f"{theirs}{norm}.bias"] = sd[f"{ours}{norm}.bias"]
        for name, source in LINEARS:
            weights[f"{theirs}{name}.weight"] = sd[f"{ours}{source}.weight"].t()
            weights[f"{theirs}{name}.bias"] = bias_of(sd, f"{ours}{source}")
    weights["transformer.ln_f.weight"], weights["transformer.ln_f.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
    return config, weights


def neox_weights(model: GPT) -> tuple[dict, dict[str, torch.Tensor]]:
    """GPT-NeoX's config and state dict for a RoPE model. NeoX lays its fused projection out head by
    head ([q, k, v] of head 0, then of head 1, ...), this model as [all q, all k, all v]: rows reordered."""
    c, sd = model.config, model.state_dict()
    D = c.n_embd // c.n_head
    config = {
        "architectures": ["GPTNeoXForCausalLM"],
        "model_type": "gpt_neox",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "intermediate_size": 4 * c.n_embd,
        "hidden_act": "gelu_new" if c.gelu == "tanh" else "gelu",
        "max_position_embeddings": c.seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base, "partial_rotary_factor": 1.0},
        "rotary_emb_base": c.rope_base,  # the names of earlier versions of transformers
        "rotary_pct": 1.0,
        "use_parallel_residual": False,
        "attention_bias": c.bias,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "layer_norm_eps": 1e-5,
        "tie_word_embeddings": False,  # written twice instead: safetensors keeps no shared tensors
    }
    head_major = torch.arange(3 * c.n_embd).view(3, c.n_head, D).transpose(0, 1).reshape(-1)
    weights = {"gpt_neox.embed_in.weight": sd["wte.weight"], "embed_out.weight": sd["wte.weight"].clone()}
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        for norm, name in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            weights[f"{theirs}{name}.weight"] = sd[f"{ours}{norm}.weight"]
            weights[f"{theirs}{name}.bias"] = sd[f"{ours}{norm}.bias"]
        weights[f"{theirs}attention.query_key_value.weight"] = sd[f"{ours}attn.qkv.weight"][head_major]
        weights[f"{theirs}attention.dense.weight"] = sd[f"{ours}attn.proj.weight"]
        if c.bias:  # NeoX's attention has biases only with attention_bias
            weights[f"{theirs}attention.query_key_value.bias"] = sd[f"{ours}attn.qkv.bias"][head_major]
            weights[f"{theirs}attention.dense.bias"] = sd[f"{ours}attn.proj.bias"]
        weights[f"{theirs}mlp.dense_h_to_4h.weight"] = sd[f"{ours}mlp.fc.weight"]
        weights[f"{theirs}mlp.dense_h_to_4h.bias"] = bias_of(sd, f"{ours}mlp.fc")
        weights[f"{theirs}mlp.dense_4h_to_h.weight"] = sd[f"{ours}mlp.proj.weight"]
        weights[f"{theirs}mlp.dense_4h_to_h.bias"] = bias_of(sd, f"{ours}mlp.proj")
    weights["gpt_neox.final_layer_norm.weight"] = sd["ln_f.weight"]
    weights["gpt_neox.final_layer_norm.bias"] = sd["ln_f.bias"]
    return config, weights


# ----------------------------------------------------------------------------------------------
# The tokenizer


def byte_characters() -> dict[int, str]:
    """The reversible byte -> character map in which byte-level BPE vocabularies are written (GPT-2's
    convention, which `tokenizers`' ByteLevel follows): printable Latin-1 bytes stand for themselves,
    the other 68 for the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def merges_of(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list that rebuilds tiktoken's ranks: each multi-byte token, in rank order, as the two
    pieces that byte-pair merging with only the lower-ranked tokens leaves of it."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) < 2:
            continue
        pieces = [bytes([b]) for b in token]
        while len(pieces) > 2:
            pair_ranks = [ranks.get(a + b, rank) for a, b in zip(pieces, pieces[1:])]
            best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[best] >= rank:
                break
            pieces[best : best + 2] = [pieces[best] + pieces[best + 1]]
        if len(pieces) != 2:
            raise ExportError(f"token {token!r} (rank {rank}) is not one merge of two lower-ranked tokens")
        merges.append((pieces[0], pieces[1]))
    return merges


def hf_tokenizer(enc: tiktoken.Encoding, context: int):
    """A transformers fast tokenizer with the same vocabulary, merges and split pattern as `enc`. A run with
    the start marker gets it as `bos_token` (else the EOT is), which the tokenizer does not add on encode:
    lm-evaluation-harness puts `bos_token` in front of every document itself, and a tokenizer that added
    it too would have the document scored from two (for `generate`: load it with add_bos_token=True)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ranks = enc._mergeable_ranks  # tiktoken exposes no public accessor for the ranks
    chars = byte_characters()

    def written(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    vocab = {written(token): rank for token, rank in ranks.items()}
    merges = [(written(a), written(b)) for a, b in merges_of(ranks)]
    # ignore_merges: a piece that is a token is that token, as tiktoken looks it up before merging
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(enc._pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = {text: enc.encode_single_token(text) for text in (EOT_TEXT, BOS_TEXT) if text in enc.special_tokens_set}
    for text, run_id in sorted(specials.items(), key=lambda item: item[1]):
        tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False)])
        if tokenizer.token_to_id(text) != run_id:
            raise ExportError(f"{text} would get id {tokenizer.token_to_id(text)}, the run's is {run_id}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOT_TEXT,
        bos_token=BOS_TEXT if BOS_TEXT in specials else EOT_TEXT,
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=context,
        split_special_tokens=True,  # a literal "<|endoftext|>" in text is text, as the run encoded it
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------------------------
# The export and its check


MAPPINGS = {"learned": gpt2_weights, "rope": neox_weights}


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
    if pos_emb not in MAPPINGS:
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
    config, weights = MAPPINGS[pos_emb](model)
    bos_id = enc.encode_single_token(BOS_TEXT) if BOS_TEXT in enc.special_tokens_set else enc.eot_token
    config.update(bos_token_id=bos_id, eos_token_id=enc.eot_token, dtype="float32")
    tmp = to.with_name(f".{to.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        from safetensors.torch import save_file

        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
        (tmp / "model.safetensors").chmod(0o644)  # safetensors writes it private
        hf_tokenizer(enc, model.config.seq_len).save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(state, out_dir, config))
        checked = check(tmp, model, enc, state)
        if to.exists():
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
