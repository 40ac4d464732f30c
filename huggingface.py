"""The Hugging Face format, both ways: a run's model and tokenizer as a GPT-2 or GPT-NeoX folder (export_hf.py
writes one and checks it against transformers), and such a folder as the weights a run starts from
(`python train.py --init_from=FOLDER`). Each mapping and its reverse sit side by side, on the same tables.

The architecture maps exactly. With learned positions it is GPT-2's (pre-LayerNorm, exact GELU, tied embeddings;
GPT-2's biases, which this model has none of by default, are written as zeros; a model with biases and tanh GELU,
as a run started from GPT-2's weights, writes its own). With RoPE it is a GPT-NeoX block (LayerNorm, exact GELU,
rotary over the whole head with the half-split pairing, sequential residual). The tokenizer is a `tokenizers`
byte-level BPE with the run's split pattern and merges, EOT as the end-of-text token.

Two kinds of folder serve init_from:

  - GPT-2 (learned positions): this repo's exports, and OpenAI's gpt2, whose biases and tanh-approximate GELU
    become the run's settings `bias` and `gelu`, so that the model computes what the folder's does;
  - GPT-NeoX as this repo exports a RoPE run: sequential residual, rotary over the whole head, base 10000.

The folder decides the model's shape, positions, biases and GELU; the run's tokenizer must be the folder's, every
token at the same id. The model keeps the folder's rows of the embedding, not rounded up to a multiple of 64 (rows
the folder never trained would change its predictions). A run with the start marker (bos) from a folder without
it adds the marker's row, set to the mean of the folder's token rows: a row of init scale would give the marker a
logit near 0, above most of a trained model's, and take probability mass from every prediction at the start.
What this model cannot compute exactly is refused in one line (ConfigError), before the run writes its files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch

from errors import ConfigError, ExportError
from model import GPT, GPTConfig
from shards import BOS_TEXT, EOT_TEXT

# (theirs, ours): the LayerNorms and the four projections of a block, in each format and in this model
GPT2_NORMS = (("ln_1", "ln_1"), ("ln_2", "ln_2"))
NEOX_NORMS = (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2"))
GPT2_LINEARS = (
    ("attn.c_attn", "attn.qkv"),
    ("attn.c_proj", "attn.proj"),
    ("mlp.c_fc", "mlp.fc"),
    ("mlp.c_proj", "mlp.proj"),
)
NEOX_LINEARS = (
    ("attention.query_key_value", "attn.qkv"),
    ("attention.dense", "attn.proj"),
    ("mlp.dense_h_to_4h", "mlp.fc"),
    ("mlp.dense_4h_to_h", "mlp.proj"),
)
GELU = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # transformers' names of the two
GELU_WRITTEN = {"exact": "gelu", "tanh": "gelu_new"}  # the names an export writes
# buffers that some versions of transformers saved with the weights: causal masks and rotary frequencies
BUFFERS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".inv_freq")
# what transformers assumes for a key a config.json leaves out (GPT2Config's and GPTNeoXConfig's defaults)
GPT2_DEFAULTS = {
    "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
}  # fmt: skip
NEOX_DEFAULTS = {
    "hidden_size": 6144, "num_hidden_layers": 44, "num_attention_heads": 64,
    "intermediate_size": 24576, "hidden_act": "gelu", "max_position_embeddings": 2048, "layer_norm_eps": 1e-5,
    "use_parallel_residual": True, "attention_bias": True, "rotary_pct": 0.25, "rotary_emb_base": 10000.0,
}  # fmt: skip
WHOLE = ("a whole number of at least 1", lambda v: type(v) is int and v >= 1)
SWITCH = ("true or false", lambda v: type(v) is bool)
NUMBER = ("a number", lambda v: type(v) in (int, float) and math.isfinite(v))
NAME = ("text", lambda v: type(v) is str)
# what each config.json field read here must be, as transformers writes it: read as it is, never converted
FIELDS = {
    "model_type": NAME,
    **dict.fromkeys(("n_positions", "n_embd", "n_layer", "n_head"), WHOLE),
    "n_inner": ("a whole number of at least 1, or null", lambda v: v is None or WHOLE[1](v)),
    **dict.fromkeys(("activation_function", "hidden_act", "rope_type"), NAME),
    **dict.fromkeys(("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "add_cross_attention"), SWITCH),
    **dict.fromkeys(("tie_word_embeddings", "use_parallel_residual", "attention_bias"), SWITCH),
    **dict.fromkeys(("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), WHOLE),
    "max_position_embeddings": WHOLE,
    **dict.fromkeys(("layer_norm_epsilon", "layer_norm_eps", "rotary_pct", "rotary_emb_base"), NUMBER),
    "rope_parameters": ("a table, or null", lambda v: v is None or isinstance(v, dict)),
    **dict.fromkeys(("rope_theta", "partial_rotary_factor"), NUMBER),  # rope_parameters' own
}


# ----------------------------------------------------------------------------------------------
# A folder as the weights a run starts from


@dataclass
class Pretrained:
    folder: Path
    settings: dict  # the run settings the folder decides (pos_emb, seq_len, n_layer, n_head, n_embd, bias, gelu)
    weights: dict[str, torch.Tensor]  # a state dict of this repo's GPT, wte.weight with the folder's rows
    vocabulary: dict[str, int]  # the folder tokenizer's tokens, as tokenizer.json writes them, and their ids

    def vocab_size(self, enc: tiktoken.Encoding) -> int:
        """The model's rows for the run's tokenizer `enc`, which is refused unless it is the folder's."""
        self.check_tokenizer(enc)
        return max(len(self.weights["wte.weight"]), enc.n_vocab)

    def check_tokenizer(self, enc: tiktoken.Encoding) -> None:
        ours, theirs = run_vocabulary(enc), self.vocabulary
        plain_ours = {t: i for t, i in ours.items() if t != BOS_TEXT}
        plain_theirs = {t: i for t, i in theirs.items() if t != BOS_TEXT}
        if plain_ours != plain_theirs:
            raise ConfigError(
                f"init_from={self.folder}: its tokenizer is not the run's ({enc.name}: "
                f"{vocabulary_difference(plain_theirs, plain_ours)}); train with the tokenizer the folder was "
                "trained with (tokenizer=gpt2 for OpenAI's GPT-2)"
            )
        if BOS_TEXT in theirs and theirs[BOS_TEXT] != ours.get(BOS_TEXT):
            raise ConfigError(
                f"init_from={self.folder} was trained with the start marker ({BOS_TEXT} at id {theirs[BOS_TEXT]}): "
                "give --bos=true"
            )

    def load_into(self, model: GPT, enc: tiktoken.Encoding) -> None:
        """The folder's weights into `model`, built with vocab_size(enc) rows; a start marker the folder
        lacks gets the mean of the folder's token rows."""
        rows = self.weights["wte.weight"]
        with torch.no_grad():
            embedding = model.wte.weight.detach().clone()
            embedding[: len(rows)] = rows
            if BOS_TEXT in enc.special_tokens_set and BOS_TEXT not in self.vocabulary:
                embedding[enc.encode_single_token(BOS_TEXT)] = rows[: max(self.vocabulary.values()) + 1].mean(0)
        model.load_state_dict({**self.weights, "wte.weight": embedding, "lm_head.weight": embedding})


def read_pretrained(folder: Path) -> Pretrained:
    """The folder's model as this repo's settings and state dict, and its tokenizer's vocabulary."""
    config = read_json(folder, "config.json", f"not a Hugging Face model folder{run_folder_hint(folder)}")
    check_fields(folder, config)
    if isinstance(config.get("rope_parameters"), dict):
        check_fields(folder, config["rope_parameters"], "rope_parameters.")
    kind = config.get("model_type")
    if kind not in FROM_HF:
        raise ConfigError(
            f"init_from={folder} holds a {kind or 'model of no model_type'}: a run starts only from a gpt2 folder "
            f"(or a gpt_neox one that export_hf.py wrote){run_folder_hint(folder)}"
        )
    vocabulary = read_vocabulary(folder)  # before the weights, which can take a while
    settings, weights = FROM_HF[kind](config, read_tensors(folder), folder)
    settings["bias"] = settle_biases(weights)
    check_shapes(folder, settings, weights)
    if max(vocabulary.values()) >= len(weights["wte.weight"]):
        raise ConfigError(
            f"init_from={folder}: its tokenizer has ids up to {max(vocabulary.values())}, and its embedding "
            f"{len(weights['wte.weight'])} rows"
        )
    return Pretrained(folder, settings, weights, vocabulary)


def check_fields(folder: Path, fields: dict, within: str = "") -> None:
    """Each field of config.json this module reads is of the type transformers writes, or one line names it."""
    for key, value in fields.items():
        expected, fits = FIELDS.get(key, ("", lambda v: True))
        if not fits(value):
            shown = json.dumps(value)[:80]
            raise ConfigError(f"init_from={folder}: config.json's {within}{key} is {shown}, not {expected}")


# ----------------------------------------------------------------------------------------------
# The two mappings, each way: this model -> (config.json, state dict), and (config.json, tensors) -> (settings,
# state dict)


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
        "activation_function": GELU_WRITTEN[c.gelu],  # exact unless started from GPT-2
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
    }
    weights = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"]}
    for i in range(c.n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        weights.update(norms_named(sd, ours, theirs, GPT2_NORMS))
        for name, source in GPT2_LINEARS:
            weights[f"{theirs}{name}.weight"] = sd[f"{ours}{source}.weight"].t()
            weights[f"{theirs}{name}.bias"] = bias_of(sd, f"{ours}{source}")
    weights["transformer.ln_f.weight"], weights["transformer.ln_f.bias"] = sd["ln_f.weight"], sd["ln_f.bias"]
    return config, weights


def gpt2_model(config: dict, tensors: dict[str, torch.Tensor], folder: Path) -> tuple[dict, dict]:
    """gpt2_weights backwards: GPT-2's Conv1D layers keep their weights as (in, out), transposed."""
    c = {**GPT2_DEFAULTS, **config}
    refuse_unless(folder, c["n_inner"] in (None, 4 * c["n_embd"]), f"an MLP {c['n_inner']} wide, not 4 x n_embd")
    refuse_unless(folder, c["layer_norm_epsilon"] == 1e-5, f"LayerNorm epsilon {c['layer_norm_epsilon']}, not 1e-5")
    refuse_unless(
        folder,
        c["scale_attn_weights"] and not c["scale_attn_by_inverse_layer_idx"] and not c["add_cross_attention"],
        "attention scaled otherwise than by 1/sqrt(head size), or cross-attention",
    )
    settings = dict(
        pos_emb="learned", seq_len=c["n_positions"], n_layer=c["n_layer"], n_head=c["n_head"], n_embd=c["n_embd"],
        gelu=gelu_of(folder, c["activation_function"]),
    )  # fmt: skip
    weights = {"wte.weight": take(tensors, "wte.weight", folder), "wpe.weight": take(tensors, "wpe.weight", folder)}
    for i in range(c["n_layer"]):
        theirs, ours = f"h.{i}.", f"blocks.{i}."
        weights.update(norms_taken(tensors, theirs, ours, GPT2_NORMS, folder))
        for name, source in GPT2_LINEARS:
            weights[f"{ours}{source}.weight"] = take(tensors, f"{theirs}{name}.weight", folder).t().contiguous()
            weights[f"{ours}{source}.bias"] = take(tensors, f"{theirs}{name}.bias", folder)
    for part in ("weight", "bias"):
        weights[f"ln_f.{part}"] = take(tensors, f"ln_f.{part}", folder)
    check_tied(folder, weights["wte.weight"], tensors.pop("lm_head.weight", None), c["tie_word_embeddings"])
    check_all_taken(folder, tensors)
    return settings, weights


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
        "hidden_act": GELU_WRITTEN[c.gelu],
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
        weights.update(norms_named(sd, ours, theirs, NEOX_NORMS))
        for name, source in NEOX_LINEARS:
            weights[f"{theirs}{name}.weight"] = sd[f"{ours}{source}.weight"]
            if name.startswith("mlp") or c.bias:  # NeoX's attention has biases only with attention_bias
                weights[f"{theirs}{name}.bias"] = bias_of(sd, f"{ours}{source}")
        weights[f"{theirs}attention.query_key_value.weight"] = weights[f"{theirs}attention.query_key_value.weight"][
            head_major
        ]
        if c.bias:
            weights[f"{theirs}attention.query_key_value.bias"] = weights[f"{theirs}attention.query_key_value.bias"][
                head_major
            ]
    weights["gpt_neox.final_layer_norm.weight"] = sd["ln_f.weight"]
    weights["gpt_neox.final_layer_norm.bias"] = sd["ln_f.bias"]
    return config, weights


def neox_model(config: dict, tensors: dict[str, torch.Tensor], folder: Path) -> tuple[dict, dict]:
    """neox_weights backwards: the fused projection's rows from head by head back to [q, k, v]."""
    c = {**NEOX_DEFAULTS, **config}
    rope = c.get("rope_parameters") or {}
    C, H = c["hidden_size"], c["num_attention_heads"]
    refuse_unless(folder, not c["use_parallel_residual"], "a parallel residual (Pythia's)")
    refuse_unless(folder, rope.get("partial_rotary_factor", c["rotary_pct"]) == 1.0, "rotary over part of each head")
    base = rope.get("rope_theta", c["rotary_emb_base"])
    refuse_unless(folder, base == GPTConfig.rope_base, f"a rotary base of {base}, not {GPTConfig.rope_base}")
    refuse_unless(folder, rope.get("rope_type", "default") == "default", "scaled rotary positions")
    refuse_unless(folder, c["intermediate_size"] == 4 * C, f"an MLP {c['intermediate_size']} wide, not 4 x width")
    refuse_unless(folder, c["layer_norm_eps"] == 1e-5, f"LayerNorm epsilon {c['layer_norm_eps']}, not 1e-5")
    settings = dict(
        pos_emb="rope", seq_len=c["max_position_embeddings"], n_layer=c["num_hidden_layers"], n_head=H, n_embd=C,
        gelu=gelu_of(folder, c["hidden_act"]),
    )  # fmt: skip
    back = torch.arange(3 * C).view(3, H, C // H).transpose(0, 1).reshape(-1).argsort()
    weights = {"wte.weight": take(tensors, "gpt_neox.embed_in.weight", folder)}
    for i in range(c["num_hidden_layers"]):
        theirs, ours = f"gpt_neox.layers.{i}.", f"blocks.{i}."
        weights.update(norms_taken(tensors, theirs, ours, NEOX_NORMS, folder))
        for name, source in NEOX_LINEARS:
            weights[f"{ours}{source}.weight"] = take(tensors, f"{theirs}{name}.weight", folder)
            if name.startswith("mlp") or c["attention_bias"]:
                weights[f"{ours}{source}.bias"] = take(tensors, f"{theirs}{name}.bias", folder)
        weights[f"{ours}attn.qkv.weight"] = weights[f"{ours}attn.qkv.weight"][back]
        if c["attention_bias"]:
            weights[f"{ours}attn.qkv.bias"] = weights[f"{ours}attn.qkv.bias"][back]
    for part in ("weight", "bias"):
        weights[f"ln_f.{part}"] = take(tensors, f"gpt_neox.final_layer_norm.{part}", folder)
    check_tied(folder, weights["wte.weight"], tensors.pop("embed_out.weight", None), tied=False)
    check_all_taken(folder, tensors)
    return settings, weights


TO_HF = {"learned": gpt2_weights, "rope": neox_weights}  # by the model's pos_emb
FROM_HF = {"gpt2": gpt2_model, "gpt_neox": neox_model}  # by config.json's model_type


def norms_named(sd: dict[str, torch.Tensor], ours: str, theirs: str, norms: tuple) -> dict[str, torch.Tensor]:
    """A block's LayerNorms (`ours`: its prefix in this model's state dict) under the format's names."""
    return {f"{theirs}{name}.{part}": sd[f"{ours}{norm}.{part}"] for name, norm in norms for part in ("weight", "bias")}


def bias_of(sd: dict[str, torch.Tensor], layer: str) -> torch.Tensor:
    """A projection's bias: zeros where the model has none (GPT-2's format has a place for it)."""
    return sd.get(f"{layer}.bias", torch.zeros(len(sd[f"{layer}.weight"])))


def settle_biases(weights: dict[str, torch.Tensor]) -> bool:
    """Whether the model needs biases in its projections. All zero (this repo's exports write them so) they are
    dropped: a model without them computes the same. Else the ones the folder lacks are zeros."""
    projections = [k for k in weights if k.endswith(tuple(f"{ours}.weight" for _, ours in GPT2_LINEARS))]
    biases = [k.replace(".weight", ".bias") for k in projections]
    if not any(weights[k].any() for k in biases if k in weights):
        for k in biases:
            weights.pop(k, None)
        return False
    for weight, bias in zip(projections, biases):
        weights.setdefault(bias, torch.zeros(len(weights[weight])))
    return True


def check_shapes(folder: Path, settings: dict, weights: dict[str, torch.Tensor]) -> None:
    """Every tensor has the shape that the folder's config.json gives this repo's model."""
    try:
        with torch.device("meta"):  # shapes only: no memory, no init
            model = GPT(GPTConfig(vocab_size=len(weights["wte.weight"]), **settings))
    except (ValueError, ZeroDivisionError, TypeError, OverflowError) as e:  # zeros, wrong types, huge numbers
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__  # torch appends its C++ stack
        raise ConfigError(
            f"init_from={folder}: config.json describes no model this one can build ({first_line})"
        ) from None
    for name, expected in model.state_dict().items():
        if name != "lm_head.weight" and weights[name].shape != expected.shape:
            raise ConfigError(
                f"init_from={folder}: {name} has shape {tuple(weights[name].shape)} in model.safetensors, and "
                f"{tuple(expected.shape)} by its config.json"
            )


def check_tied(folder: Path, embedding: torch.Tensor, output: torch.Tensor | None, tied: bool) -> None:
    if (output is None and not tied) or (output is not None and not torch.equal(output, embedding)):
        raise ConfigError(
            f"init_from={folder}: its output layer is not its input embedding, and this model ties the two"
        )


def check_all_taken(folder: Path, left: dict[str, torch.Tensor]) -> None:
    unknown = sorted(name for name in left if not name.endswith(BUFFERS))
    if unknown:
        raise ConfigError(
            f"init_from={folder}: model.safetensors holds tensors this model has no place for ({', '.join(unknown[:3])}"
            f"{', ...' if len(unknown) > 3 else ''})"
        )


def refuse_unless(folder: Path, representable: bool, what: str) -> None:
    if not representable:
        raise ConfigError(f"init_from={folder}: its model has {what}; this repo's model cannot compute that")


def gelu_of(folder: Path, activation: str) -> str:
    refuse_unless(folder, activation in GELU, f"the activation {activation!r}, not GELU")
    return GELU[activation]


def norms_taken(tensors: dict[str, torch.Tensor], theirs: str, ours: str, norms: tuple, folder: Path) -> dict:
    """norms_named backwards: a block's LayerNorms, taken from the folder's tensors, under this model's names."""
    return {
        f"{ours}{norm}.{part}": take(tensors, f"{theirs}{name}.{part}", folder)
        for name, norm in norms
        for part in ("weight", "bias")
    }


def take(tensors: dict[str, torch.Tensor], name: str, folder: Path) -> torch.Tensor:
    if name not in tensors:
        raise ConfigError(f"init_from={folder}: model.safetensors has no tensor {name}, which its config.json implies")
    return tensors.pop(name)


# ----------------------------------------------------------------------------------------------
# The tokenizer, each way


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


BYTE_CHARACTERS = byte_characters()


def written(token: bytes) -> str:
    """A token as byte-level BPE vocabularies and merge lists write it."""
    return "".join(BYTE_CHARACTERS[b] for b in token)


def run_vocabulary(enc: tiktoken.Encoding) -> dict[str, int]:
    """The run's tokens as tokenizer.json writes them (hf_tokenizer's vocabulary), and their ids."""
    return {written(token): rank for token, rank in enc._mergeable_ranks.items()} | enc._special_tokens


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


def vocabulary_difference(theirs: dict[str, int], ours: dict[str, int]) -> str:
    if len(theirs) != len(ours):
        return f"{len(ours):,} tokens, the folder's {len(theirs):,}"
    token = next(t for t in ours if theirs.get(t) != ours[t])
    return f"token {token!r} has id {ours[token]}, in the folder's {theirs.get(token)}"


# ----------------------------------------------------------------------------------------------
# The folder's files, each way


def write_folder(folder: Path, model: GPT, enc: tiktoken.Encoding) -> dict:
    """A new folder of `model` (fp32) and its tokenizer `enc`: config.json, model.safetensors and the tokenizer's
    files; returns the config written. Needs safetensors, tokenizers and transformers (else ImportError)."""
    from safetensors.torch import save_file

    config, weights = TO_HF[model.config.pos_emb](model)
    bos_id = enc.encode_single_token(BOS_TEXT) if BOS_TEXT in enc.special_tokens_set else enc.eot_token
    config.update(bos_token_id=bos_id, eos_token_id=enc.eot_token, dtype="float32")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    (folder / "model.safetensors").chmod(0o644)  # safetensors writes it private
    hf_tokenizer(enc, model.config.seq_len).save_pretrained(folder)
    return config


def read_json(folder: Path, name: str, missing: str) -> dict:
    """folder/name, a JSON object; `missing` says what its absence means."""
    path = folder / name
    if not folder.is_dir():
        raise ConfigError(f"init_from={folder} is not a folder: give a Hugging Face model folder")
    if not path.is_file():
        raise ConfigError(f"init_from={folder} has no {name}: {missing}")
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from={folder}: {name} cannot be read ({e})") from None
    if not isinstance(content, dict):
        raise ConfigError(f"init_from={folder}: {name} is not a JSON object")
    return content


def run_folder_hint(folder: Path) -> str:
    if (folder / "ckpt.pt").is_file():
        return (
            " (it is a run of train.py: continue it with --out_dir=that folder --resume=true, or export it with "
            "export_hf.py)"
        )
    return ""


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors in float32, names without the `transformer.` prefix (OpenAI's gpt2 has none)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / "model.safetensors"
    if not path.is_file():
        raise ConfigError(f"init_from={folder} has no model.safetensors (the weights are read only from that file)")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"init_from={folder}: model.safetensors cannot be read ({e})") from None
    return {name.removeprefix("transformer."): tensor.float() for name, tensor in tensors.items()}


def read_vocabulary(folder: Path) -> dict[str, int]:
    """The folder tokenizer's tokens and ids: tokenizer.json's BPE vocabulary and its added (special) tokens."""
    content = read_json(folder, "tokenizer.json", "the run's tokenizer cannot be compared with the folder's")
    model = content.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ConfigError(f"init_from={folder}: tokenizer.json holds no BPE vocabulary to compare with the run's")
    vocabulary, added = dict(model["vocab"]), content.get("added_tokens", [])
    if not isinstance(added, list) or not all(isinstance(t, dict) and isinstance(t.get("content"), str) for t in added):
        raise ConfigError(f"init_from={folder}: tokenizer.json's added_tokens are not content/id entries")
    vocabulary.update({token["content"]: token.get("id") for token in added})
    if not all(type(i) is int and i >= 0 for i in vocabulary.values()):
        raise ConfigError(f"init_from={folder}: tokenizer.json holds token ids that are not whole numbers, 0 or more")
    if not vocabulary:
        raise ConfigError(f"init_from={folder}: tokenizer.json holds no tokens")
    return vocabulary
