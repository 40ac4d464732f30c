"""train.py --init_from=FOLDER: a run starts from the weights of a Hugging Face folder. The two mappings read
the export's backwards exactly; an export of a run starts a run whose model is the exported one (the same logits
and validation loss); a GPT-2 made locally with transformers (biases, tanh GELU) computes here what it computes
there; a folder whose kind, shape or tokenizer does not fit is refused in one line, with no run file written."""

import json

import pytest
import torch
from conftest import rewrite_checkpoint, tiny_args
from safetensors.torch import save_file

import export_hf
import huggingface
import sample
import shards
import train
from cli import parse_config
from config import Config
from model import GPT, GPTConfig
from resolve import resolve, with_pretrained_shape
from run.checkpoint import read_checkpoint
from shards import BOS_TEXT

SHAPE = dict(seq_len=64, n_layer=2, n_head=2, n_embd=32)  # tiny_args' model
RUN_FILES = ("config.json", "ckpt.pt", "metrics.jsonl")


def tiny_model(pos_emb="learned", vocab_size=320, **changes) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab_size, pos_emb=pos_emb, **SHAPE, **changes))
    with torch.no_grad():  # nonzero everywhere, biases and LayerNorms included, so that no mapping hides
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def write_folder(folder, model: GPT, vocabulary: dict, config_changes=None, extra_tensors=None):
    """A Hugging Face folder of `model` as an export maps it, with a tokenizer.json of `vocabulary` (no
    transformers needed: init_from reads only its vocabulary)."""
    config, weights = huggingface.TO_HF[model.config.pos_emb](model)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({**config, **(config_changes or {})}))
    tensors = {name: tensor.contiguous() for name, tensor in {**weights, **(extra_tensors or {})}.items()}
    save_file(tensors, folder / "model.safetensors")
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocabulary}}))
    return folder


def logits(model: GPT, vocab: int, T: int = 64) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        return model(ids, torch.arange(T).expand(2, T), None)


def start_args(corpus, data_dir, out, folder, **overrides) -> list[str]:
    """A run from `folder` of one step at learning rate 0: its checkpoint holds the weights it started from."""
    settings = dict(lr=0, min_lr=0, warmup_iters=0, max_iters=1, eval_interval=1, **overrides)
    args = tiny_args(corpus, data_dir, out, init_from=folder, **settings)
    return [arg for arg in args if arg[2:].split("=")[0] not in SHAPE]  # the folder decides the shape


def refused(capsys, args: list[str]) -> str:
    assert train.main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def tokenizer(tiny_corpus, data_dir):
    """The tokenizer tiny_args' runs train with (its shards prepared here, found there)."""
    import prepare

    folder = prepare.prepare(str(tiny_corpus), str(data_dir), Config(tokenizer_vocab_size=320), log=lambda *a: None)
    return shards.load_tokenizer(folder)


# ----------------------------------------------------------------------------------------------
# The mappings, without training


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("gpt2_like", [False, True])
def test_an_export_read_back_is_the_same_model(tmp_path, pos_emb, gpt2_like):
    changes = dict(bias=True, gelu="tanh") if gpt2_like else {}
    model = tiny_model(pos_emb, **changes)
    folder = write_folder(tmp_path / "hf", model, {"a": 0})
    start = huggingface.read_pretrained(folder)
    assert start.settings == dict(pos_emb=pos_emb, **SHAPE, gelu="tanh" if gpt2_like else "exact", bias=gpt2_like)
    back = GPT(GPTConfig(vocab_size=320, **start.settings))
    start.load_into(back, shards.tiktoken_encoding({bytes([b]): b for b in range(256)}, r"\S+", "bytes", 319))
    assert set(back.state_dict()) == set(model.state_dict())
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
    assert torch.equal(logits(back.eval(), 320), logits(model, 320))


def test_zero_biases_are_dropped_and_gpt2s_names_without_prefix_are_read(tmp_path):
    """An export writes zero biases (the model has none); OpenAI's gpt2 names its tensors without
    `transformer.` and keeps the causal-mask buffers of old versions."""
    model = tiny_model()
    config, weights = huggingface.gpt2_weights(model)
    weights = {k.removeprefix("transformer."): v for k, v in weights.items()}
    weights["h.0.attn.bias"] = torch.ones(1, 1, 64, 64)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors")
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}}}))
    start = huggingface.read_pretrained(folder)
    assert start.settings["bias"] is False and not any(k.endswith("qkv.bias") for k in start.weights)


# ----------------------------------------------------------------------------------------------
# Refusals: one line, nothing written


def test_a_folder_that_is_not_a_model_folder_is_refused(tmp_path, tiny_corpus, capsys):
    (tmp_path / "empty").mkdir()
    run = tmp_path / "a_run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"run_id": "x", "n_layer": 2}))
    (run / "ckpt.pt").write_bytes(b"")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    no_weights = write_folder(tmp_path / "no_weights", tiny_model(), {"a": 0})
    (no_weights / "model.safetensors").unlink()
    damaged = write_folder(tmp_path / "damaged", tiny_model(), {"a": 0})
    (damaged / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    cases = {
        tmp_path / "missing": "is not a folder",
        tmp_path / "empty": "has no config.json: not a Hugging Face model folder",
        run: "it is a run of train.py: continue it with --out_dir=that folder --resume=true",
        llama: "holds a llama: a run starts only from a gpt2 folder",
        no_tokenizer: "has no tokenizer.json: the run's tokenizer cannot be compared",
        no_weights: "has no model.safetensors",
        damaged: "model.safetensors cannot be read",
    }
    for folder, message in cases.items():
        out = tmp_path / f"out_{folder.name}"
        err = refused(capsys, tiny_args(tiny_corpus, tmp_path / "data", out, init_from=folder))
        assert err.startswith(f"error: init_from={folder}") and message in err, err
        assert not out.exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    ("pos_emb", "config_changes", "message"),
    [
        ("learned", {"activation_function": "relu"}, "the activation 'relu', not GELU"),
        ("learned", {"n_inner": 64}, "an MLP 64 wide, not 4 x n_embd"),
        ("learned", {"layer_norm_epsilon": 1e-6}, "LayerNorm epsilon 1e-06"),
        ("learned", {"scale_attn_by_inverse_layer_idx": True}, "attention scaled otherwise"),
        ("learned", {"n_positions": 128}, "wpe.weight has shape (64, 32) in model.safetensors, and (128, 32) by its"),
        ("learned", {"n_layer": 3}, "model.safetensors has no tensor h.2.ln_1.weight, which its config.json implies"),
        ("learned", {"n_head": 3}, "config.json describes no model this one can build"),  # 32 wide: 3 heads do not fit
        ("learned", {"n_positions": 10**20}, "config.json describes no model this one can build (empty(): argument"),
        ("rope", {"max_position_embeddings": 10**20}, "config.json describes no model this one can build (int too big"),
        ("rope", {"use_parallel_residual": True}, "a parallel residual"),
        ("rope", {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25}}, "rotary over part"),
        ("rope", {"rope_parameters": {"rope_theta": 500000.0}}, "a rotary base of 500000.0"),
    ],
)
def test_what_this_model_cannot_compute_is_refused(tmp_path, tiny_corpus, capsys, pos_emb, config_changes, message):
    folder = write_folder(tmp_path / "hf", tiny_model(pos_emb), {"a": 0}, config_changes)
    err = refused(capsys, tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "out", init_from=folder))
    assert message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("pos_emb", "config_changes", "message"),
    [  # the issue's four, then one of each kind of field each mapping reads
        ("learned", {"n_layer": "2"}, 'n_layer is "2", not a whole number of at least 1'),
        ("learned", {"n_layer": 2.0}, "n_layer is 2.0, not a whole number of at least 1"),
        ("learned", {"activation_function": ["gelu"]}, 'activation_function is ["gelu"], not text'),
        ("learned", {"model_type": ["gpt2"]}, 'model_type is ["gpt2"], not text'),
        ("learned", {"n_head": True}, "n_head is true, not a whole number of at least 1"),
        ("learned", {"n_positions": -1}, "n_positions is -1, not a whole number of at least 1"),
        ("learned", {"n_inner": "128"}, 'n_inner is "128", not a whole number of at least 1, or null'),
        ("learned", {"layer_norm_epsilon": "1e-5"}, 'layer_norm_epsilon is "1e-5", not a number'),
        ("learned", {"tie_word_embeddings": "yes"}, 'tie_word_embeddings is "yes", not true or false'),
        ("learned", {"scale_attn_weights": "false"}, 'scale_attn_weights is "false", not true or false'),
        ("rope", {"hidden_size": "32"}, 'hidden_size is "32", not a whole number of at least 1'),
        ("rope", {"num_hidden_layers": 0}, "num_hidden_layers is 0, not a whole number of at least 1"),
        ("rope", {"hidden_act": 3}, "hidden_act is 3, not text"),
        ("rope", {"attention_bias": "no"}, 'attention_bias is "no", not true or false'),
        ("rope", {"rope_parameters": [1]}, "rope_parameters is [1], not a table, or null"),
        ("rope", {"rope_parameters": {"rope_theta": "10000"}}, 'rope_parameters.rope_theta is "10000", not a number'),
        ("rope", {"rope_parameters": None, "rotary_pct": "1"}, 'rotary_pct is "1", not a number'),
    ],
)
def test_a_config_json_field_of_the_wrong_type_is_one_line(
    tmp_path, tiny_corpus, capsys, pos_emb, config_changes, message
):
    """Every field read from the folder's config.json is checked for its type before it is used (these were
    TypeErrors, or read as true, or as another model)."""
    folder = write_folder(tmp_path / "hf", tiny_model(pos_emb), {"a": 0}, config_changes)
    err = refused(capsys, tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "out", init_from=folder))
    assert err == f"error: init_from={folder}: config.json's {message}\n"
    assert not (tmp_path / "out").exists()


def test_every_config_json_field_read_has_its_type_checked():
    read = {*huggingface.GPT2_DEFAULTS, *huggingface.NEOX_DEFAULTS, "model_type", "rope_parameters"}
    assert read | {"rope_theta", "partial_rotary_factor", "rope_type"} == set(huggingface.FIELDS)


def test_a_folder_whose_settings_no_run_takes_or_whose_token_ids_are_not_ids_is_one_line(tmp_path, tiny_corpus, capsys):
    torch.manual_seed(0)
    one_position = GPT(GPTConfig(vocab_size=320, seq_len=1, n_layer=2, n_head=2, n_embd=32))  # shapes agree
    cases = {
        write_folder(tmp_path / "one", one_position, {"a": 0}): "config.json makes seq_len=1, which is outside [2,",
        write_folder(tmp_path / "ids", tiny_model(), {"a": True}): "token ids that are not whole numbers, 0 or more",
        write_folder(tmp_path / "negative", tiny_model(), {"a": -1}): "token ids that are not whole numbers",
    }
    added = write_folder(tmp_path / "added", tiny_model(), {"a": 0})
    (added / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [
        {"content": ["<|x|>"], "id": 1}]}))  # fmt: skip
    cases[added] = "tokenizer.json's added_tokens are not content/id entries"
    for folder, message in cases.items():
        err = refused(capsys, tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "out", init_from=folder))
        assert err.startswith(f"error: init_from={folder}: ") and message in err, err
        assert not (tmp_path / "out").exists()


def test_an_output_layer_of_its_own_and_unknown_tensors_are_refused(tmp_path, tiny_corpus, capsys):
    untied = {"lm_head.weight": torch.randn(320, 32)}
    folder = write_folder(tmp_path / "untied", tiny_model(), {"a": 0}, extra_tensors=untied)
    err = refused(capsys, tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "out", init_from=folder))
    assert "its output layer is not its input embedding" in err
    folder = write_folder(
        tmp_path / "extra", tiny_model(), {"a": 0}, extra_tensors={"h.9.mlp.c_fc.weight": torch.ones(2)}
    )
    err = refused(capsys, tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "out", init_from=folder))
    assert "holds tensors this model has no place for (h.9.mlp.c_fc.weight)" in err


def test_a_setting_that_contradicts_the_folder_is_refused_and_the_folders_are_taken(tmp_path, tiny_corpus, capsys):
    folder = write_folder(tmp_path / "hf", tiny_model(), {"a": 0})
    args = tiny_args(tiny_corpus, tmp_path / "data", tmp_path / "out", init_from=folder)
    for given, message in (("--n_layer=3", "n_layer=3, but"), ("--pos_emb=rope", "pos_emb='rope', but")):
        err = refused(capsys, [a for a in args if not a.startswith(given.split("=")[0] + "=")] + [given])
        assert err.startswith(f"error: {message} init_from={folder} has") and "drop the setting" in err, err
    assert not (tmp_path / "out").exists()
    cfg = parse_config([a for a in args if a[2:].split("=")[0] not in SHAPE])  # the defaults: 256, 4, 4, 128
    cfg = with_pretrained_shape(cfg, huggingface.read_pretrained(folder), say=lambda line: None)
    assert (cfg.seq_len, cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.bias, cfg.gelu) == (64, 2, 2, 32, False, "exact")


def test_init_from_the_run_folder_itself_is_refused(tmp_path, tiny_corpus, capsys):
    folder = write_folder(tmp_path / "hf", tiny_model(), {"a": 0})
    err = refused(capsys, tiny_args(tiny_corpus, tmp_path / "data", folder, init_from=folder))
    assert "init_from and out_dir are the same folder" in err
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_a_tokenizer_that_is_not_the_folders_is_refused(tmp_path, tiny_corpus, data_dir, tokenizer, capsys):
    vocabulary = huggingface.run_vocabulary(tokenizer)
    swapped = dict(vocabulary)
    first, second = list(vocabulary)[260:262]
    swapped[first], swapped[second] = vocabulary[second], vocabulary[first]
    smaller = {t: i for t, i in vocabulary.items() if i < 300}
    cases = {
        "swapped": (swapped, f"token {first!r} has id {vocabulary[first]}, in the folder's {vocabulary[second]}"),
        "smaller": (smaller, "320 tokens, the folder's 300"),
        "marker": ({**vocabulary, BOS_TEXT: 320}, f"was trained with the start marker ({BOS_TEXT} at id 320)"),
    }
    for name, (tokens, message) in cases.items():
        folder = write_folder(tmp_path / name, tiny_model(vocab_size=384), tokens)
        out = tmp_path / f"out_{name}"
        err = refused(capsys, start_args(tiny_corpus, data_dir, out, folder))
        assert message in err, err
        assert not any((out / f).exists() for f in RUN_FILES)


# ----------------------------------------------------------------------------------------------
# Through train.py


def model_of(run) -> tuple[GPT, dict]:
    state = read_checkpoint(run / "ckpt.pt")
    return sample.trained_model(state, torch.device("cpu")), state


@pytest.mark.slow
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_a_run_started_from_an_export_has_the_exported_model(tmp_path, tiny_corpus, data_dir, pos_emb, capsys):
    """Train, export, start a new run from the export: one step at learning rate 0 keeps the weights, so its
    checkpoint and its evaluation are the exported run's (to the last bit); a fresh optimizer, step 1."""
    run = tmp_path / "run"
    train.train(resolve(parse_config(tiny_args(tiny_corpus, data_dir, run, pos_emb=pos_emb))))
    export_hf.export(run, tmp_path / "hf")
    train.train(resolve(parse_config(start_args(tiny_corpus, data_dir, tmp_path / "started", tmp_path / "hf"))))
    assert f"init_from: starting from the weights in {tmp_path / 'hf'}" in capsys.readouterr().out
    (original, before), (started, after) = model_of(run), model_of(tmp_path / "started")
    difference = float((logits(original, 320) - logits(started, 320)).abs().max())
    with capsys.disabled():  # the measurement, shown with pytest -s
        print(f"round trip through export and init_from ({pos_emb}): max |logit difference| {difference:.1e}")
    assert difference <= 1e-5
    assert after["evaluation"]["val_doc_loss"] == pytest.approx(before["evaluation"]["val_doc_loss"], abs=1e-6)
    assert after["step"] == 1 and all(s["step"] == 1 for s in after["optimizer"]["state"].values())
    assert after["config"]["init_from"] == str(tmp_path / "hf") and after["config"]["pos_emb"] == pos_emb

    # resuming it reads the checkpoint, not the folder (gone now); a run that did not start from it may not
    (tmp_path / "hf").rename(tmp_path / "moved")
    resumed = ["--out_dir=" + str(tmp_path / "started"), "--resume=true", "--max_iters=2"]
    assert train.main(resumed) == 0
    err = refused(capsys, [f"--out_dir={run}", "--resume=true", f"--init_from={tmp_path / 'moved'}"])
    assert f"cannot resume {run} with other settings (init_from: '' -> '{tmp_path / 'moved'}')" in err

    def before_these_settings(settings: dict) -> dict:  # as a run saved before they existed
        return {k: v for k, v in settings.items() if k not in ("bias", "gelu", "init_from")}

    rewrite_checkpoint(run / "ckpt.pt", lambda state: state.update(config=before_these_settings(state["config"])))
    (run / "config.json").write_text(json.dumps(before_these_settings(json.loads((run / "config.json").read_text()))))
    assert train.main([f"--out_dir={run}", "--resume=true", "--max_iters=7"]) == 0  # it ran as their defaults do


@pytest.mark.slow
@pytest.mark.parametrize("bos", [False, True])
def test_a_gpt2_made_with_transformers_computes_what_it_computes_there(tmp_path, tiny_corpus, data_dir, tokenizer, bos):
    """A tiny GPT-2 of transformers' own (biases, tanh GELU, 320 rows: no padding), saved offline with the run's
    tokenizer. With the marker its row is added, the mean of the others. The run's export writes the biases and
    the GELU back (export_hf's check holds it to the run's logits)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / "gpt2")
    huggingface.hf_tokenizer(tokenizer, 64).save_pretrained(tmp_path / "gpt2")
    train.train(resolve(parse_config(start_args(tiny_corpus, data_dir, tmp_path / "run", tmp_path / "gpt2", bos=bos))))
    model, state = model_of(tmp_path / "run")
    assert (state["config"]["bias"], state["config"]["gelu"]) == (True, "tanh")
    assert model.config.vocab_size == 320 + bos
    ids = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids, torch.arange(64).expand(2, 64), None), hf(input_ids=ids).logits
    difference = float((ours[..., :320] - theirs).abs().max())
    print(f"tiny GPT-2 (bos={bos}): max |logit difference| against transformers {difference:.1e}")
    assert difference <= 1e-5
    if bos:
        assert torch.equal(model.wte.weight[320], hf.transformer.wte.weight.mean(0))
    checked = export_hf.export(tmp_path / "run", tmp_path / "exported")
    assert checked["max_abs_logit_difference"] <= export_hf.LOGIT_TOLERANCE
    exported = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert exported["activation_function"] == "gelu_new"
