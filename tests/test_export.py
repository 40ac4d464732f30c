"""export_hf.py: a run becomes a Hugging Face folder that transformers loads offline and that reproduces
the run: its fp32 logits, its tokenizer's ids and its greedy generation; a transposed weight or a
reordered head is caught; bad requests are one line."""

import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from conftest import rewrite_checkpoint, tiny_args

import checkpoints
import data
import export_hf
import files
import sample
import train
from config import Config, parse_config
from shards import BOS_TEXT, EOT_TEXT, decoded, document_opening, leading_documents, load_shards

pytestmark = pytest.mark.slow  # every test here trains a model first

PROMPT = "def f(value):\n    return"


@pytest.fixture(scope="module", params=["learned", "rope", "learned+bos", "rope+bos"])
def run(request, tiny_corpus, tmp_path_factory):
    pos_emb, bos = request.param.split("+")[0], request.param.endswith("+bos")
    out = tmp_path_factory.mktemp(f"run_{pos_emb}_{'bos' if bos else 'plain'}")
    args = tiny_args(tiny_corpus, tmp_path_factory.mktemp("data"), out, max_iters=30, eval_interval=30, eval_tokens=0)
    train.train(parse_config(args + [f"--pos_emb={pos_emb}", f"--bos={bos}", "--lr=1e-2", "--warmup_iters=5"]))
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "model"
    checked = export_hf.export(run, folder)
    return folder, checked


def ours(run):
    state = checkpoints.read_checkpoint(run / "ckpt.pt")
    return sample.trained_model(state, torch.device("cpu")), sample.checkpoint_tokenizer(state), state


def test_the_folder_loads_offline_with_the_auto_classes(exported, run):
    folder, checked = exported
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in folder.iterdir()}
    offline = subprocess.run(  # a fresh process, so that transformers reads the offline switch at import
        [
            sys.executable,
            "-c",
            f"import transformers as t; t.AutoModelForCausalLM.from_pretrained({str(folder)!r}); "
            f"t.AutoTokenizer.from_pretrained({str(folder)!r})",
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert offline.returncode == 0, offline.stderr[-2000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pos_emb = json.loads((run / "config.json").read_text())["pos_emb"]
    assert type(model).__name__ == {"learned": "GPT2LMHeadModel", "rope": "GPTNeoXForCausalLM"}[pos_emb]
    _, enc, _ = ours(run)
    assert tokenizer.eos_token_id == enc.eot_token == model.config.eos_token_id
    card = (folder / "README.md").read_text()
    assert "doc_mask=True" in card and "val_doc_loss" in card and "nats per token" in card
    assert checked["max_abs_logit_difference"] <= export_hf.LOGIT_TOLERANCE and checked["tokenizer_texts"] > 10


def test_fp32_logits_equal_the_runs_at_every_length(exported, run):
    folder, _ = exported
    model, enc, _ = ours(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for T in (1, 2, 31, model.config.seq_len):
        ids = torch.randint(0, enc.n_vocab, (3, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            difference = (model(ids, torch.arange(T).expand(3, T), None) - hf(input_ids=ids).logits).abs().max()
        assert difference <= 1e-4, (T, float(difference))


def test_the_tokenizer_gives_the_runs_ids(exported, run):
    folder, _ = exported
    _, enc, state = ours(run)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    texts = export_hf.validation_texts(state, enc) + ["x = 1\n" * 50, "   \n\n\t \u00a0 \u2028 end", "ÀÉÎ õü ß 𝔘𝔫𝔦"]
    for text in texts:
        ids = enc.encode_ordinary(text)
        assert tokenizer.encode(text, add_special_tokens=False) == ids, text[:80]
        assert tokenizer(text)["input_ids"] == document_opening(enc, text), text[:80]  # the BOS, when the run has it
        assert tokenizer.decode(ids) == text
    assert len(texts) > 20
    assert any(BOS_TEXT in text for text in texts) and any(EOT_TEXT in text for text in texts)  # literals stay text


def test_greedy_generation_gives_the_tokens_of_sample_py(exported, run, capsys):
    folder, _ = exported
    model, enc, _ = ours(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.tensor([document_opening(enc, PROMPT)])
    theirs = hf.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=enc.eot_token, pad_token_id=0)
    mine = model.generate(prompt, 20, temperature=0, stop_token=enc.eot_token)
    assert theirs[0].tolist() == mine[0].tolist()
    capsys.readouterr()
    assert sample.main([f"--out_dir={run}", f"--prompt={PROMPT}", "--temperature=0", "--max_new_tokens=20"]) == 0
    printed = capsys.readouterr().out.split("\n", 1)[1].rstrip("\n")
    assert printed == decoded(enc, theirs[0].tolist())
    assert (BOS_TEXT in enc.special_tokens_set) == (theirs[0, 0] == enc.n_vocab - 1)  # sampling starts at the BOS


def test_the_exports_log_likelihood_of_a_document_is_the_runs_loss_of_it_alone(exported, run):
    """What lm-evaluation-harness and `generate` see: the tokenizer's encoding of a validation document (the
    BOS first, when the run has the marker) and its EOT, scored by the exported model, gives the loss the
    run's own evaluation logged for that document."""
    folder, _ = exported
    _, enc, state = ours(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    cfg = Config(**state["config"])
    shards = load_shards(state["shards"])
    val = leading_documents(shards.val, shards.eot_id, cfg.eval_tokens)
    starts, ends = data.document_bounds(val, shards.eot_id)
    logged = [r for _, r in files.read_metrics(run / "metrics.jsonl") if "val_doc_loss" in r][-1]
    checked = 0
    for i, (s, e) in enumerate(zip(starts, ends)):
        ids = tokenizer(enc.decode(val[s : e - 1].tolist()))["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) > cfg.seq_len + 1:  # the run scores a longer document in chunks, the export cannot
            continue
        ids = torch.tensor([ids])
        with torch.no_grad():
            logits = hf(input_ids=ids[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
        assert logged["val_doc_count_by_document"][i] == ids.shape[1] - 1
        assert float(loss) == pytest.approx(logged["val_doc_loss_sum_by_document"][i], abs=2e-3)
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("defect", ["transposed", "heads reordered"])
def test_the_check_catches_a_transposed_weight_or_reordered_heads(run, tmp_path, monkeypatch, defect):
    pos_emb = json.loads((run / "config.json").read_text())["pos_emb"]
    mapping = export_hf.MAPPINGS[pos_emb]

    def broken(model):
        config, weights = mapping(model)
        name = next(k for k in weights if k.endswith(("attn.c_attn.weight", "attention.query_key_value.weight")))
        if defect == "transposed":  # the square output projection of layer 0
            square = next(k for k in weights if k.endswith(("attn.c_proj.weight", "attention.dense.weight")))
            weights[square] = weights[square].t().contiguous()
        else:  # the first two heads' rows (or columns) swapped in the fused projection
            w = weights[name]
            D = model.config.n_embd // model.config.n_head
            axis = 1 if pos_emb == "learned" else 0  # GPT-2 keeps (in, out)
            order = torch.arange(w.shape[axis])
            order[:D], order[D : 2 * D] = order[D : 2 * D].clone(), order[:D].clone()
            weights[name] = w.index_select(axis, order)
        return config, weights

    monkeypatch.setitem(export_hf.MAPPINGS, pos_emb, broken)
    with pytest.raises(export_hf.ExportError, match="logits differ"):
        export_hf.export(run, tmp_path / "broken")
    assert not (tmp_path / "broken").exists()


def test_refusals_are_one_line(run, tmp_path, capsys):
    assert export_hf.main([f"--out_dir={tmp_path / 'none'}", f"--to={tmp_path / 'x'}"]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'none' / 'ckpt.pt'} not found")
    (tmp_path / "taken").mkdir()
    assert export_hf.main([f"--out_dir={run}", f"--to={tmp_path / 'taken'}"]) == 1
    assert "exists: give another --to, or --overwrite=true" in capsys.readouterr().err
    (tmp_path / "odd").mkdir()
    rewrite_checkpoint(
        run / "ckpt.pt", lambda state: state["model_config"].update(pos_emb="alibi"), tmp_path / "odd" / "ckpt.pt"
    )
    assert export_hf.main([f"--out_dir={tmp_path / 'odd'}", f"--to={tmp_path / 'y'}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pos_emb='alibi' has no Hugging Face mapping" in err
