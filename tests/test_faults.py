"""Fault injection, round 3: truncated inputs in every compressed format, interrupts and kills at random
points during preparation and training, damaged run and data folders, reruns with changed settings,
processes that fail under torchrun, and the everyday edges (resume by naming the run, ~ in paths, one
command-line convention, pipes that close early, extreme sampling temperatures).

Each case must end in a working result or one `error:`/`interrupted:` line with nothing half-written;
`FAULT_CASES` counts the distinct cases tried (python -m pytest tests/test_faults.py -s prints it)."""

import gzip
import itertools
import json
import random
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, make_documents, tiny_args

import corpora
import prepare
import sample
import shards
import train
from cli import parse_config
from config import Config
from errors import ConfigError, DataError, Stopped
from model import GPT, GPTConfig
from run import processes
from run.folder import RunFiles, hold

SMALL = Config(tokenizer_vocab_size=300)
QUIET = dict(log=lambda *_: None)
FAULT_CASES: dict[str, int] = {}


def tried(kind: str, n: int = 1) -> None:
    FAULT_CASES[kind] = FAULT_CASES.get(kind, 0) + n


def jsonl_bytes(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def python(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kwargs)


def one_line(result: subprocess.CompletedProcess, prefix: str = "error:") -> str:
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), result.stderr[-2000:]
    return lines[0]


def complete_folders(data_dir: Path) -> list[Path]:
    return [p for p in data_dir.iterdir() if (p / "meta.json").exists()] if data_dir.exists() else []


# ---- truncated compressed corpora: never read as complete


def compressed(kind: str, docs: list[str]) -> tuple[bytes, set[int]]:
    """The corpus in `kind`'s format, and the cut points that leave a valid, shorter file (between frames
    or members: no format can tell those from a complete file)."""
    raw = jsonl_bytes(docs)
    if kind in ("gz", "zst"):
        if kind == "gz":
            return gzip.compress(raw), set()
        import zstandard

        return zstandard.ZstdCompressor().compress(raw), set()
    pieces = [raw[i : i + 4000] for i in range(0, len(raw), 4000)]
    if kind == "gz_members":
        frames = [gzip.compress(p) for p in pieces]
    else:
        import zstandard

        frames = [zstandard.ZstdCompressor().compress(p) for p in pieces]
    return b"".join(frames), set(np.cumsum([len(f) for f in frames]).tolist())


@pytest.mark.parametrize("kind", ["gz", "zst", "gz_members", "zst_frames"])
def test_a_truncated_compressed_jsonl_is_never_read_as_complete(tmp_path, kind):
    docs = make_documents(200)
    content, valid_cuts = compressed(kind, docs)
    suffix = ".jsonl.gz" if kind.startswith("gz") else ".jsonl.zst"
    rng = random.Random(0)
    cuts = {rng.randrange(1, len(content)) for _ in range(40)} | {len(content) - 1, len(content) - 4}
    cuts |= {c + d for c in valid_cuts for d in (-1, 1) if 0 < c + d < len(content)}
    for cut in sorted(cuts):
        path = tmp_path / f"cut{cut}{suffix}"
        path.write_bytes(content[:cut])
        try:
            got = list(corpora.read_documents(corpora.resolve_dataset(str(path))))
        except DataError as e:
            assert str(path) in str(e) and "\n" not in str(e)
        else:
            assert cut in valid_cuts, f"a cut at byte {cut} of {len(content)} read as complete ({len(got)} docs)"
        tried("truncated compressed file")


def test_a_truncated_parquet_file_is_refused(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "full.parquet"
    pq.write_table(pa.table({"text": make_documents(300)}), path, row_group_size=50)
    content = path.read_bytes()
    for cut in sorted({*random.Random(1).sample(range(1, len(content)), 15), len(content) - 1}):
        cut_path = tmp_path / f"cut{cut}.parquet"
        cut_path.write_bytes(content[:cut])
        with pytest.raises(DataError, match="parquet"):
            list(corpora.read_documents(corpora.resolve_dataset(str(cut_path))))
        tried("truncated compressed file")


@pytest.mark.parametrize("layout", ["dictionary", "large_string", "string_view"])
def test_parquet_text_in_every_arrow_string_layout_is_read(tmp_path, layout):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    docs = make_documents(20)
    column = {
        "dictionary": lambda: pa.array(docs).dictionary_encode(),
        "large_string": lambda: pa.array(docs, type=pa.large_string()),
        "string_view": lambda: pa.array(docs, type=pa.string_view()),
    }[layout]()
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": column}), path, store_schema=True)
    assert list(corpora.read_documents(corpora.resolve_dataset(str(path)))) == docs
    tried("parquet string layout")


# ---- damaged data folders and confusing datasets


@pytest.fixture
def prepared(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(60)))
    return prepare.prepare(str(corpus), str(tmp_path / "data"), SMALL, **QUIET)


@pytest.mark.parametrize("missing", shards.PREPARED_FILES)
def test_a_prepared_folder_that_lacks_a_file_is_refused_not_read_as_text(prepared, missing):
    (prepared / missing).unlink()
    with pytest.raises(DataError, match=f"incomplete preparation|{missing} is missing"):
        shards.load_shards(prepare.prepare(str(prepared), str(prepared.parent.parent / "other"), SMALL, **QUIET))
    tried("damaged data folder")


@pytest.mark.parametrize("key", shards.META_KEYS)
def test_a_meta_json_without_a_key_is_named(prepared, key):
    meta = json.loads((prepared / "meta.json").read_text())
    del meta[key]
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"meta.json lacks {key}"):
        shards.load_shards(prepared)
    tried("damaged data folder")


@pytest.mark.parametrize("key", shards.SETTINGS_KEYS)
def test_a_meta_json_without_a_data_setting_is_named(prepared, key):
    """Training on a prepared folder adopts these: without one it would stop with a KeyError."""
    meta = json.loads((prepared / "meta.json").read_text())
    del meta["settings"][key]
    (prepared / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"meta.json lacks settings.{key}"):
        shards.load_shards(prepared)
    tried("damaged data folder")


def test_a_dataset_that_is_the_data_dir_is_refused_under_any_spelling(prepared, tmp_path, monkeypatch):
    data_dir = prepared.parent
    (tmp_path / "link").symlink_to(data_dir)
    monkeypatch.chdir(tmp_path)
    for spelling in (str(data_dir), "data", "./data/../data", "link", str(prepared.parent / prepared.name / "..")):
        with pytest.raises(DataError, match="is the data_dir or out_dir of this run"):
            prepare.prepare(spelling, str(data_dir), SMALL, exclude=(data_dir, tmp_path / "out"), **QUIET)
        tried("dataset that is the data_dir")


def test_a_preparation_lock_that_is_a_folder_is_one_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(60)))
    source = corpora.resolve_dataset(str(corpus))
    name = prepare.shard_dir_for(str(tmp_path / "data"), source, SMALL, corpora.fingerprint(source)).name
    (tmp_path / "data" / f".{name}.lock").mkdir(parents=True)
    with pytest.raises(DataError, match="cannot serve as the preparation's lock"):
        prepare.prepare(str(corpus), str(tmp_path / "data"), SMALL, **QUIET)
    tried("damaged data folder")


def test_a_symbolic_link_loop_under_a_recursive_glob_ends(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i, doc in enumerate(make_documents(5)):
        (corpus / "sub" / f"{i}.txt").write_text(doc)
    (corpus / "sub" / "loop").symlink_to(corpus)
    result = python(
        "-c", f"import corpora; print(len(corpora.resolve_dataset({str(corpus / '**' / '*.txt')!r}).files))", timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "5", result.stderr
    tried("symbolic-link loop")


def test_a_tokenizer_smaller_than_asked_says_so_and_its_folder_says_its_size(tmp_path):
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_bytes(jsonl_bytes(["abc abd", "bcd bce", "cde"] * 3 + [f"x{i}" for i in range(5)]))
    said = []
    settings = Config(tokenizer_vocab_size=5000, val_fraction=0.3)
    path = prepare.prepare(str(corpus), str(tmp_path / "data"), settings, log=said.append)
    real = shards.load_shards(path).meta["vocab_size"]
    assert real < 5000 and path.name.split("-")[1] == f"bpe{real}"
    assert any(f"only {real:,} tokens" in line and "5,000" in line for line in said)
    assert prepare.prepare(str(corpus), str(tmp_path / "data"), settings, log=said.append) == path  # found again
    tried("small tokenizer")


# ---- interrupts and kills during preparation


@pytest.mark.slow
def test_interrupts_and_kills_at_random_points_of_preparation_leave_it_clean_and_resumable(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(30000, seed=3)))
    command = [sys.executable, "prepare.py", str(corpus), "--tokenizer_vocab_size=300"]
    reference = python(*command[1:], f"--data_dir={tmp_path / 'reference'}")
    assert reference.returncode == 0, reference.stderr
    (expected,) = complete_folders(tmp_path / "reference")
    seconds = json.loads((expected / "timings.json").read_text())["seconds"]["total"]  # tokenizer, encoding, shards
    data_dir = tmp_path / "data"
    rng = random.Random(0)
    interrupted, latest = 0, 0.5 * seconds
    for _ in range(16):
        if interrupted == 8:
            break
        signum = signal.SIGINT if interrupted % 2 == 0 else signal.SIGKILL  # as many of each
        proc = subprocess.Popen(
            [*command, f"--data_dir={data_dir}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Ctrl-C as from a terminal, even when pytest runs as a background job (which ignores SIGINT,
            # and a child that starts with SIGINT ignored keeps ignoring it)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        while proc.poll() is None and not list(data_dir.glob(f".*.tmp-{proc.pid}")):  # its preparation has begun
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, latest))  # a random point of the preparation
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
        tried("interrupt or kill during preparation")
        if proc.returncode == 0:  # it had finished (later runs are faster than the first): start afresh, sooner
            (done,) = complete_folders(data_dir)
            shutil.rmtree(done)
            latest /= 2
            continue
        interrupted += 1
        assert complete_folders(data_dir) == []  # nothing that looks complete
        if signum == signal.SIGINT:
            assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
            assert (stdout + stderr).count("interrupted:") == 1
            assert not list(data_dir.glob(".*.tmp-*"))  # the unfinished preparation was removed
    assert interrupted == 8
    finished = python(*command[1:], f"--data_dir={data_dir}")
    assert finished.returncode == 0, finished.stderr
    (folder,) = complete_folders(data_dir)
    assert folder.name == expected.name
    for shard in sorted(expected.glob("*.bin")):
        assert (folder / shard.name).read_bytes() == shard.read_bytes()
    assert not list(data_dir.glob(".*.tmp-*"))


@pytest.mark.slow
def test_a_full_disk_or_a_file_size_limit_while_preparing_or_benchmarking_is_one_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(4000, seed=5)))

    def limit_files_to(n_bytes):
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))

    prepared = python(
        "prepare.py",
        str(corpus),
        f"--data_dir={tmp_path / 'data'}",
        "--tokenizer_vocab_size=300",
        preexec_fn=limit_files_to(50_000),
    )
    assert prepared.returncode == 1 and "could not write the shards" in one_line(prepared)
    assert complete_folders(tmp_path / "data") == [] and not list((tmp_path / "data").glob(".*.tmp-*"))
    bench = python(
        "-m",
        "bench.attention",
        f"--out={tmp_path / 'bench.json'}",
        "--steps=1",
        "--warmup=0",
        preexec_fn=limit_files_to(1),
    )
    assert bench.returncode == 1 and "could not write" in one_line(bench)
    tried("full disk or file-size limit", 2)


# ---- training: a second Ctrl-C, damaged run folders, resume by naming the run


@pytest.fixture(scope="module")
def reference_run(tiny_corpus, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")

    def args(out_dir, **overrides):
        return tiny_args(tiny_corpus, data_dir, out_dir, **{"max_iters": 12, "eval_interval": 3, **overrides})

    reference = tmp_path_factory.mktemp("reference")
    train.train(parse_config(args(reference)))
    return args, records(reference)


def records(out_dir: Path) -> list[dict]:
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if "per_sec" not in k} for line in lines]


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_in_one_line_and_the_run_resumes_by_its_name(reference_run, tmp_path):
    args, _ = reference_run
    out = tmp_path / "run"
    # a model slow enough per step that the second Ctrl-C lands within the step the first one lets finish
    slow = args(out, max_iters=400, eval_interval=100, n_embd=128, n_head=4, seq_len=128, batch_size=16)
    proc = subprocess.Popen(
        [sys.executable, "train.py", *slow], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if line.startswith("step   110/"):
            break
    proc.send_signal(signal.SIGINT)
    for line in proc.stdout:
        if line.startswith("SIGINT: finishing this step"):
            proc.send_signal(signal.SIGINT)
            break
    _, stderr = proc.communicate(timeout=120)
    tried("second Ctrl-C during a step")
    assert proc.returncode == 130, stderr[-2000:]
    message = one_line(subprocess.CompletedProcess([], 130, "", stderr), "interrupted:")
    assert f"python train.py --out_dir={out} --resume=true" in message
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 100  # the last checkpoint, intact
    assert not (out / "ckpt.pt.tmp").exists()
    resumed = python("train.py", f"--out_dir={out}", "--resume=true", "--max_iters=102")  # settings from config.json
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(out / "ckpt.pt", weights_only=False)["step"] == 102


@pytest.mark.slow
def test_resuming_by_name_keeps_the_saved_settings_and_names_what_may_not_change(reference_run, tmp_path, monkeypatch):
    args, uninterrupted = reference_run
    out = tmp_path / "run"
    ctrl_c_at_step_6 = lambda self, step, every, device: signal.SIGINT * (step == 6)  # noqa: E731
    monkeypatch.setattr(processes.StopRequest, "agreed", ctrl_c_at_step_6)
    with pytest.raises(Stopped):
        train.train(parse_config(args(out)))
    monkeypatch.undo()
    cfg = parse_config([f"--out_dir={out}", "--resume=true"])
    assert cfg == parse_config(args(out) + ["--resume=true"])  # every saved setting
    assert parse_config([f"--out_dir={out}", "--resume=true", "--max_iters=20"]).max_iters == 20  # may change
    for change, name in (("--lr=0.5", "lr"), ("--seq_len=32", "seq_len"), ("--doc_mask=false", "doc_mask")):
        with pytest.raises(ConfigError, match=f"cannot resume {out} with other settings \\({name}: "):
            parse_config([f"--out_dir={out}", "--resume=true", change])
        tried("rerun with a changed setting")
    with (out / "metrics.jsonl").open("a") as log:  # a kill while the next line was being written
        log.write('{"step": 7, "train_lo')
    train.train(cfg)
    assert records(out) == uninterrupted  # the cut line dropped (with a warning), the run exact
    tried("damaged run folder")
    (out / "config.json").write_text("{ damaged")  # the checkpoint holds the settings too
    assert parse_config([f"--out_dir={out}", "--resume=true"]) == cfg
    tried("damaged run folder")


@pytest.mark.slow
def test_damaged_run_folders_are_one_line(reference_run, tmp_path):
    args, _ = reference_run
    out = tmp_path / "run"
    train.train(parse_config(args(out, max_iters=3)))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], "{ damaged", *lines[1:]]) + "\n")
    with pytest.raises(ConfigError, match=r"metrics.jsonl:2 is not a metrics record"):
        train.train(parse_config(args(out, max_iters=6) + ["--resume=true"]))
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (out / ".lock").unlink()
    (out / ".lock").mkdir()
    with pytest.raises(ConfigError, match=r"\.lock cannot serve as the run's lock"):
        train.train(parse_config(args(out, max_iters=6) + ["--resume=true"]))
    tried("damaged run folder", 2)


# ---- several processes: an error on one stops them all, in one line


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="needs gloo")
def test_an_error_before_the_first_barrier_stops_every_process_with_one_line(reference_run, tmp_path):
    args, _ = reference_run
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    held = tmp_path / "held"
    train.train(parse_config(args(held, max_iters=1)))  # a finished run: a new one into it is refused
    for case, argv in (
        ("bad data", args(tmp_path / "a") + [f"--dataset={tmp_path / 'missing.jsonl'}"]),
        ("refused out_dir", args(held)),
    ):
        t0 = time.time()
        result = python(*torchrun, *argv, timeout=180)
        assert result.returncode != 0 and time.time() - t0 < 120, case
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "gloo" not in result.stderr.lower(), (case, result.stderr[-3000:])
        tried("error on one process under torchrun")


# ---- sampling and pipes


def test_sampling_at_extreme_temperatures_gives_tokens():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=1, n_head=2, n_embd=16)).eval()
    prompt = torch.tensor([[1, 2, 3]])
    greedy = model.generate(prompt, 10, temperature=0)
    for temperature in (1e-300, 1e-45, 1e-8, 1e8, 1e300):
        out = model.generate(prompt, 10, temperature=temperature, top_k=None)
        assert out.shape == (1, 13) and int(out.max()) < 64
        if temperature < 1e-6:
            assert torch.equal(out, greedy)
        tried("extreme temperature")


@pytest.mark.slow
def test_output_into_a_pipe_that_closes_early_ends_quietly(reference_run, tmp_path):
    args, _ = reference_run
    out = tmp_path / "run"
    train.train(parse_config(args(out, max_iters=1, eval_interval=1)))
    proc = subprocess.Popen(
        [sys.executable, "sample.py", f"--out_dir={out}", "--num_samples=400", "--max_new_tokens=30"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert proc.returncode == 141 and "Traceback" not in stderr and stderr.strip() == "", stderr[-2000:]
    tried("closed output pipe")


# ---- the command line's conventions


def test_one_command_line_convention_everywhere(capsys):
    with pytest.raises(ConfigError, match="bad argument '--max_iters': use --key=value"):
        parse_config(["--max_iters", "5"])
    with pytest.raises(SystemExit) as exit_code:
        sample.main(["--out_dir", "out"])
    assert exit_code.value.code == 2 and "bad argument '--out_dir': use --key=value" in capsys.readouterr().err
    tried("--key value", 2)


def test_a_corpus_where_the_config_file_goes_says_to_use_dataset(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(3)))
    with pytest.raises(ConfigError, match=f"give it as --dataset={corpus}"):
        parse_config([str(corpus)])
    (tmp_path / "empty.jsonl").write_text("")  # would parse as an empty TOML file: the defaults
    with pytest.raises(ConfigError, match="is not a .toml config file"):
        parse_config([str(tmp_path / "empty.jsonl")])
    with pytest.raises(ConfigError, match=f"is a folder, not a config file .*give it as --dataset={tmp_path}"):
        parse_config([str(tmp_path)])
    tried("corpus given as a config file", 3)


def test_a_leading_tilde_is_the_home_folder_for_every_path(tmp_path, monkeypatch):
    from studies import plan

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text('data_dir = "~/d"\n')
    cfg = parse_config(["~/c.toml", "--out_dir=~/run", "--dataset=~/corpus.jsonl", "--tokenizer=~/t.tiktoken"])
    assert (cfg.data_dir, cfg.out_dir) == (f"{tmp_path}/d", f"{tmp_path}/run")
    assert (cfg.dataset, cfg.tokenizer) == (f"{tmp_path}/corpus.jsonl", f"{tmp_path}/t.tiktoken")
    toml = tmp_path / "study.toml"
    toml.write_text('data_dir = "~/d"\n[ablate]\nout_dir = "~/study"\n')
    study, _ = plan.parse_args([str(toml)])
    assert study.out_dir == f"{tmp_path}/study"
    tried("~ in a path", 6)


def test_evaluation_suits_the_run_and_shows_progress(monkeypatch, capsys):
    from config import Config

    assert train.eval_token_budget(Config()) == 8 * 256 * 300 // 4  # the quickstart: a quarter between evals
    assert train.eval_token_budget(Config(max_iters=10)) == 32_768  # a tiny run: the floor
    assert train.eval_token_budget(Config(batch_size=64, seq_len=1024, eval_interval=1000)) == 1_000_000
    assert train.eval_token_budget(Config(eval_tokens=0)) == 0 and train.eval_token_budget(Config(eval_tokens=5)) == 5
    # every row of every micro-batch and process counts: 2 x 2 x 8 x 256 tokens a step, 300 steps, a quarter
    assert train.eval_token_budget(Config(grad_accum=2), world_size=2) == 614_400
    clock = itertools.count(0, 4)  # every call 4 "seconds" later
    monkeypatch.setattr(train.time, "time", lambda: next(clock))
    progress = train.evaluation_progress(10, print)
    for _ in range(10):
        progress.advance(1)
    lines = capsys.readouterr().out.splitlines()
    assert lines and all(line.startswith("eval: ") and "/10 batches, ETA" in line for line in lines)


# ---- the end-of-text id of a named encoding, export targets, moved and replaced run folders


def test_a_named_encoding_keeps_its_end_of_text_id_through_shards_and_checkpoints(tmp_path, monkeypatch):
    """tiktoken's named encodings put EOT after a gap (cl100k_base: 100257 for 100256 ranks); reloading
    must not guess max rank + 1. A stand-in encoding, since the real ones download their files."""
    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    fake = tiktoken.Encoding(
        "fake", pat_str=prepare.SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 300}
    )
    monkeypatch.setattr(prepare.tiktoken, "get_encoding", lambda name: fake)
    corpus = tmp_path / "c.jsonl"
    corpus.write_bytes(jsonl_bytes(make_documents(40)))
    path = prepare.prepare(str(corpus), str(tmp_path / "data"), Config(tokenizer="fake"), **QUIET)
    assert shards.load_shards(path).eot_id == 300 == shards.load_tokenizer(path).eot_token
    state = {
        "tokenizer": {
            "name": "fake",
            "pattern": prepare.SPLIT_PATTERN,
            "file": (path / "tokenizer.tiktoken").read_bytes(),
            "eot_id": 300,
        }
    }
    assert sample.checkpoint_tokenizer(state).eot_token == 300
    gapped = {k: v + (v >= 100) for k, v in ranks.items()}  # no rank 100
    fake = tiktoken.Encoding(
        "gapped", pat_str=prepare.SPLIT_PATTERN, mergeable_ranks=gapped, special_tokens={"<|endoftext|>": 300}
    )
    with pytest.raises(DataError, match="has gaps in its ranks"):
        prepare.load_named_tokenizer("gapped")
    tried("named encoding", 2)


@pytest.mark.slow
def test_export_never_replaces_the_run_the_working_folder_or_a_folder_that_is_not_an_export(
    reference_run, tmp_path, monkeypatch
):
    import export_hf

    args, _ = reference_run
    out = tmp_path / "runs" / "run"
    train.train(parse_config(args(out, max_iters=1, eval_interval=1)))
    monkeypatch.chdir(tmp_path)
    for to in (out, out.parent, tmp_path, Path("/")):
        with pytest.raises(export_hf.ExportError, match="is the run's folder, the working folder or a folder above"):
            export_hf.export(out, to, overwrite=True)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(export_hf.ExportError, match="is not an exported model folder"):
        export_hf.export(out, tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "keep.txt").exists() and (out / "ckpt.pt").exists()
    tried("export target", 5)


@pytest.mark.slow
def test_a_moved_run_resumes_where_it_is_and_overwrite_keeps_the_old_run_until_it_has_a_checkpoint(
    reference_run, tmp_path
):
    args, _ = reference_run
    first = tmp_path / "first"
    train.train(parse_config(args(first, max_iters=3)))
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    shutil.rmtree(first)
    cfg = parse_config([f"--out_dir={moved}", "--resume=true", "--max_iters=6"])
    assert cfg.out_dir == str(moved)  # not the folder its config.json was written in
    train.train(cfg)
    assert not first.exists() and torch.load(moved / "ckpt.pt", weights_only=False)["step"] == 6
    with hold(moved, resume=False, overwrite=True):
        run_files = RunFiles(moved, "new", fresh=True)  # a kill now leaves the old run whole
        assert run_files.path("ckpt.pt") == moved / ".replacing" / "ckpt.pt" and (moved / "ckpt.pt").exists()
    tried("moved or replaced run folder", 2)


def test_report_the_cases_tried():
    """How many distinct fault cases this file tried (run it last: python -m pytest tests/test_faults.py -s)."""
    print(f"fault cases tried: {sum(FAULT_CASES.values())} ({', '.join(f'{k} {n}' for k, n in FAULT_CASES.items())})")
    assert FAULT_CASES
