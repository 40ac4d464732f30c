"""Start a run from the weights of a Hugging Face model folder (`python train.py --init_from=FOLDER`): export_hf's
mappings read backwards. Two kinds of folder serve:

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
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tiktoken
import torch

from config import Config, setting_problem
from errors import ConfigError
from export_hf import LINEARS as GPT2_LINEARS
from export_hf import byte_characters
from model import GPT, GPTConfig
from shards import BOS_TEXT

GELU = {"gelu": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # transformers' names of the two
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
# (theirs, ours) for the four projections of a block, as export_hf.LINEARS for GPT-2
NEOX_LINEARS = (
    ("attention.query_key_value", "attn.qkv"),
    ("attention.dense", "attn.proj"),
    ("mlp.dense_h_to_4h", "mlp.fc"),
    ("mlp.dense_4h_to_h", "mlp.proj"),
)
# buffers that some versions of transformers saved with the weights: causal masks and rotary frequencies
BUFFERS = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".inv_freq")


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
    if kind not in MAPPINGS:
        raise ConfigError(
            f"init_from={folder} holds a {kind or 'model of no model_type'}: a run starts only from a gpt2 folder "
            f"(or a gpt_neox one that export_hf.py wrote){run_folder_hint(folder)}"
        )
    vocabulary = read_vocabulary(folder)  # before the weights, which can take a while
    settings, weights = MAPPINGS[kind](config, read_tensors(folder), folder)
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


def start_of(cfg: Config) -> Pretrained:
    """The weights of the folder init_from names, with its model settings made the run's; read before out_dir
    is touched, so that a folder that cannot serve is refused with nothing written (its tokenizer is compared
    with the run's in train.build_model, before any run file)."""
    start = read_pretrained(Path(cfg.init_from))
    adopt_settings(cfg, start, print if int(os.environ.get("RANK", "0")) == 0 else lambda line: None)
    return start


def adopt_settings(cfg: Config, start: Pretrained, log: Callable[[str], None] = print) -> None:
    """The folder's model settings become the run's (config.json records them); one given otherwise (not its
    default) contradicts the folder and is refused."""
    defaults = Config()
    for key, value in start.settings.items():
        if problem := setting_problem(key, value):  # a whole number can still be one no run takes (seq_len=1)
            raise ConfigError(f"init_from={start.folder}: its config.json makes {key}={value!r}, which {problem}")
        given = getattr(cfg, key)
        if given != value and given != getattr(defaults, key):
            raise ConfigError(
                f"{key}={given!r}, but init_from={start.folder} has {key}={value!r}: drop the setting to start "
                "from that folder"
            )
        setattr(cfg, key, value)
    shape = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in start.settings.items())
    log(f"init_from: starting from the weights in {start.folder}, which decide the model: {shape}")


# ----------------------------------------------------------------------------------------------
# The two mappings: (config.json, tensors) -> (settings, state dict)


def gpt2_model(config: dict, tensors: dict[str, torch.Tensor], folder: Path) -> tuple[dict, dict]:
    """export_hf.gpt2_weights backwards: GPT-2's Conv1D layers keep their weights as (in, out), transposed."""
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
        for norm in ("ln_1", "ln_2"):
            for part in ("weight", "bias"):
                weights[f"{ours}{norm}.{part}"] = take(tensors, f"{theirs}{norm}.{part}", folder)
        for name, source in GPT2_LINEARS:
            weights[f"{ours}{source}.weight"] = take(tensors, f"{theirs}{name}.weight", folder).t().contiguous()
            weights[f"{ours}{source}.bias"] = take(tensors, f"{theirs}{name}.bias", folder)
    for part in ("weight", "bias"):
        weights[f"ln_f.{part}"] = take(tensors, f"ln_f.{part}", folder)
    check_tied(folder, weights["wte.weight"], tensors.pop("lm_head.weight", None), c["tie_word_embeddings"])
    check_all_taken(folder, tensors)
    return settings, weights


def neox_model(config: dict, tensors: dict[str, torch.Tensor], folder: Path) -> tuple[dict, dict]:
    """export_hf.neox_weights backwards: the fused projection's rows from head by head back to [q, k, v]."""
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
        for name, norm in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
            for part in ("weight", "bias"):
                weights[f"{ours}{norm}.{part}"] = take(tensors, f"{theirs}{name}.{part}", folder)
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


MAPPINGS = {"gpt2": gpt2_model, "gpt_neox": neox_model}


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
    except (ValueError, ZeroDivisionError, TypeError) as e:  # a config.json of zeros or of the wrong types
        raise ConfigError(f"init_from={folder}: config.json describes no model this one can build ({e})") from None
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


def take(tensors: dict[str, torch.Tensor], name: str, folder: Path) -> torch.Tensor:
    if name not in tensors:
        raise ConfigError(f"init_from={folder}: model.safetensors has no tensor {name}, which its config.json implies")
    return tensors.pop(name)


# ----------------------------------------------------------------------------------------------
# The folder's files


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


def run_vocabulary(enc: tiktoken.Encoding) -> dict[str, int]:
    """The run's tokens as tokenizer.json writes them (export_hf.hf_tokenizer's vocabulary), and their ids."""
    chars = byte_characters()
    vocabulary = {"".join(chars[b] for b in token): rank for token, rank in enc._mergeable_ranks.items()}
    return vocabulary | enc._special_tokens


def vocabulary_difference(theirs: dict[str, int], ours: dict[str, int]) -> str:
    if len(theirs) != len(ours):
        return f"{len(ours):,} tokens, the folder's {len(theirs):,}"
    token = next(t for t in ours if theirs.get(t) != ours[t])
    return f"token {token!r} has id {ours[token]}, in the folder's {theirs.get(token)}"
