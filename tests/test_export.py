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

import export_hf
import huggingface
import sample
import train
from cli import parse_config
from config import Config
from resolve import resolve
from run.checkpoint import read_checkpoint
from run.folder import read_metrics
from shards import BOS_TEXT, EOT_TEXT, decoded, document_bounds, document_opening, leading_documents, load_shards

pytestmark = pytest.mark.slow  # every test here trains a model first

PROMPT = "def f(value):\n    return"


@pytest.fixture(scope="module", params=["learned", "rope", "learned+bos", "rope+bos"])
def run(request, tiny_corpus, tmp_path_factory):
    pos_emb, bos = request.param.split("+")[0], request.param.endswith("+bos")
    out = tmp_path_factory.mktemp(f"run_{pos_emb}_{'bos' if bos else 'plain'}")
    args = tiny_args(tiny_corpus, tmp_path_factory.mktemp("data"), out, max_iters=30, eval_interval=30, eval_tokens=0)
    train.train(resolve(parse_config(args + [f"--pos_emb={pos_emb}", f"--bos={bos}", "--lr=1e-2", "--warmup_iters=5"])))
    return out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "model"
    checked = export_hf.export(run, folder)
    return folder, checked


def ours(run):
    state = read_checkpoint(run / "ckpt.pt")
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
    marker = BOS_TEXT in enc.special_tokens_set
    for_generate = transformers.AutoTokenizer.from_pretrained(folder, add_bos_token=True) if marker else tokenizer
    texts = export_hf.validation_texts(state, enc) + ["x = 1\n" * 50, "   \n\n\t \u00a0 \u2028 end", "ÀÉÎ õü ß 𝔘𝔫𝔦"]
    for text in texts:
        ids = enc.encode_ordinary(text)
        assert tokenizer(text)["input_ids"] == ids, text[:80]  # by default nothing is added: lm-eval adds the BOS
        assert for_generate(text)["input_ids"] == document_opening(enc, text), text[:80]  # the BOS, under the marker
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


def lm_eval_windows(tokens: list[int], prefix: int, context: int) -> list[tuple[list[int], list[int]]]:
    """(inputs, targets) of the windows in which lm-evaluation-harness 0.4.13 scores a document's tokens
    with `loglikelihood_rolling` (lm_eval/utils.py get_rolling_token_windows with context_len=1, then
    make_disjoint_window, then the causal input HFLM._loglikelihood_tokens builds), written out here: the
    first window is `prefix` and the first `context` - 1 tokens, predicting up to `context` tokens; each
    later one predicts the next (up to) `context` tokens from the `context` tokens just before the last of
    them. The targets are predicted at the last len(targets) positions of a window's inputs."""
    first = min(context, len(tokens))
    windows = [([prefix] + tokens[: first - 1], tokens[:first])]
    done = first
    while done < len(tokens):
        end = min(len(tokens), done + context)
        windows.append((tokens[end - context - 1 : end - 1], tokens[done:end]))
        done = end
    return windows


def lm_eval_context(config) -> int:
    """The context lm-eval 0.4.13 gives a model: the first of these config fields it has (models/utils.py)."""
    return next(getattr(config, k) for k in ("n_positions", "max_position_embeddings", "n_ctx") if hasattr(config, k))


def test_lm_evaluation_harness_scores_a_document_as_the_run_did(exported, run):
    """`lm_eval --model hf --model_args pretrained=EXPORT` (version 0.4.13, default settings): its rolling
    log-likelihood encodes a document with the tokenizer's defaults and puts `bos_token` in front. Under the
    marker that is the run's evaluation of the document alone, less the EOT target, which lm-eval does not
    score; a document longer than the context is scored in the run's own chunks, except the last window,
    which lm-eval fills up with earlier tokens. Without the marker lm-eval puts the EOT in front, a start
    the run never evaluates (the README says so)."""
    folder, _ = exported
    _, enc, state = ours(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    cfg = Config(**state["config"])
    shards = load_shards(state["shards"])
    val = leading_documents(shards.val, shards.eot_id, cfg.eval_tokens)
    starts, ends = document_bounds(val, shards.eot_id)
    logged = [r for _, r in read_metrics(run / "metrics.jsonl") if "val_doc_loss" in r][-1]
    prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    T = lm_eval_context(hf.config)
    assert T == cfg.seq_len
    if not cfg.bos:
        assert prefix == enc.eot_token
        return
    fitting = longer = 0
    for i, (s, e) in enumerate(zip(starts, ends)):
        text = enc.decode(val[s : e - 1].tolist())
        windows = lm_eval_windows(tokenizer(text)["input_ids"], prefix, T)
        row = document_opening(enc, text) + [enc.eot_token]  # the run's document alone: BOS, text, EOT
        if len(row) > T + 1:  # the run's chunks start every T tokens; all but the last are lm-eval's windows
            for k, (inputs, targets) in enumerate(windows[:-1]):
                assert inputs == row[k * T : (k + 1) * T] and targets == row[k * T + 1 : (k + 1) * T + 1]
            longer += len(windows) > 1
            continue
        ((inputs, targets),) = windows
        assert inputs + targets[-1:] == row[:-1]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([row[:-1]])).logits[0]
        losses = torch.nn.functional.cross_entropy(logits, torch.tensor(row[1:]), reduction="none")
        lm_eval_nll, eot = losses[-len(targets) - 1 : -1].sum(), losses[-1]  # lm-eval's targets; the run's last
        assert float(lm_eval_nll + eot) == pytest.approx(logged["val_doc_loss_sum_by_document"][i], abs=2e-3)
        assert len(targets) + 1 == logged["val_doc_count_by_document"][i]
        fitting += 1
    assert fitting >= 5 and longer >= 1


@pytest.mark.parametrize("defect", ["transposed", "heads reordered"])
def test_the_check_catches_a_transposed_weight_or_reordered_heads(run, tmp_path, monkeypatch, defect):
    pos_emb = json.loads((run / "config.json").read_text())["pos_emb"]
    mapping = huggingface.TO_HF[pos_emb]

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

    monkeypatch.setitem(huggingface.TO_HF, pos_emb, broken)
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


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 128, 129, 300])
def test_the_written_out_windows_are_lm_evals_own(length):
    """lm_eval_windows against lm-evaluation-harness itself, where it is installed (it is not a requirement)."""
    utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(100, 100 + length))
    theirs = []
    for context, targets in map(utils.make_disjoint_window, utils.get_rolling_token_windows(tokens, 7, 64, 1)):
        theirs.append(((context + targets)[-65:][:-1], targets))  # HFLM._loglikelihood_tokens' causal input
    assert lm_eval_windows(tokens, 7, 64) == theirs
