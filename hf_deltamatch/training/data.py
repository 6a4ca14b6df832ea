"""Data for the recipes: an offline corpus, a locally trained tokenizer, loading with `datasets`, and packing.

Packing keeps document boundaries: every fixed-length block remembers the lengths of the document pieces it
holds (`doc_lens`), and `PackedCollator` hands those pieces to transformers' own `DataCollatorWithFlattening`,
which emits `position_ids` restarting at every document plus `cu_seq_lens_q/k` and `max_length_q/k`. Those
kwargs flow from `model(**batch)` down to the attention function (flash-attention layout), sdpa/eager get a
block-diagonal causal mask from the position_ids resets, and labels get -100 at every document start so no
token is trained to predict across a boundary.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path

import torch

from .config import ConfigError, TrainConfig, _looks_like_hub_name

EOS = "<|endoftext|>"

# ---------------------------------------------------------------------------------------------------------
# The offline corpus: Python's own standard library (sources) and its pydoc topic texts (language docs).
# ---------------------------------------------------------------------------------------------------------

_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}


def _stdlib_documents(max_bytes: int):
    """Yield {"text", "source"} documents in a fixed order (so the corpus is the same on every machine
    with the same Python version). Pydoc topics first, then .py files sorted by path."""
    total = 0
    try:
        from pydoc_data.topics import topics

        for key in sorted(topics):
            text = topics[key].strip()
            if len(text) > 200:
                total += len(text.encode())
                yield {"text": text, "source": f"pydoc:{key}"}
    except ImportError:  # some distributions strip pydoc_data
        pass
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS & set(rel.parts) or rel.parts[0].startswith("config-"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200:
            continue
        total += len(text.encode())
        if total > max_bytes:
            return
        yield {"text": text, "source": str(rel)}


def build_stdlib_corpus(cache_root: str | os.PathLike, max_bytes: int) -> Path:
    """Write the stdlib corpus to <cache_root>/stdlib-py3X-<bytes>/docs.jsonl once; return the file."""
    ver = f"py{sys.version_info.major}{sys.version_info.minor}"
    out = Path(cache_root) / f"stdlib-{ver}-{max_bytes}" / "docs.jsonl"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as f:
        for doc in _stdlib_documents(max_bytes):
            f.write(json.dumps(doc) + "\n")
            n += 1
    if n == 0:
        raise ConfigError(f"found no Python sources under {sysconfig.get_paths()['stdlib']} to build the corpus; "
                          "pass --data with your own text files.")
    os.replace(tmp, out)  # atomic: a concurrent process never sees half a file
    return out


def default_cache_root() -> Path:
    return Path(os.environ.get("HF_DELTAMATCH_CACHE", Path.home() / ".cache" / "hf_deltamatch"))


# ---------------------------------------------------------------------------------------------------------
# Loading text with `datasets`
# ---------------------------------------------------------------------------------------------------------


def _format_of(path: str) -> str:
    p = path.lower()
    if p.endswith((".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst")):
        return "json"
    if p.endswith(".parquet"):
        return "parquet"
    if p.endswith((".txt", ".txt.gz", ".md")):
        return "text"
    raise ConfigError(f"cannot tell the format of {path!r}; set --data_format text|json|parquet.")


def resolve_data(cfg: TrainConfig) -> tuple[str, object]:
    """(datasets builder name, data_files or hub name)."""
    if cfg.data == "stdlib":
        return "json", [str(build_stdlib_corpus(default_cache_root() / "corpus", cfg.corpus_bytes))]
    patterns = [cfg.data] if isinstance(cfg.data, str) else list(cfg.data)
    one_hub_name = len(patterns) == 1 and _looks_like_hub_name(patterns[0])
    if cfg.data_format == "hub" or (one_hub_name and cfg.data_format == "auto"):
        return "hub", patterns[0]
    files = sorted({f for pat in patterns for f in glob.glob(str(pat), recursive=True)})
    if not files:
        raise ConfigError(f"--data {cfg.data!r} matches no file.")
    fmt = cfg.data_format if cfg.data_format != "auto" else _format_of(files[0])
    other = {f for f in files if cfg.data_format == "auto" and _format_of(f) != fmt}
    if other:
        raise ConfigError(f"--data mixes formats ({files[0]} is {fmt}, but {sorted(other)[:3]} are not).")
    return fmt, files


def load_text_splits(cfg: TrainConfig):
    """(train, validation) datasets of documents with a `text` column. Map-style unless cfg.streaming."""
    from datasets import load_dataset

    from .tasks import task_of

    task = task_of(cfg)
    if task is not None:  # a generated task: its own fixed validation sequences (training/tasks.py)
        train, val = task.build(default_cache_root() / "tasks", cfg.seq_len, cfg.data_seed)
        ds = load_dataset("json", data_files={"train": str(train), "validation": str(val)}, streaming=cfg.streaming)
        return ds["train"], ds["validation"]
    builder, source = resolve_data(cfg)
    if builder == "hub":
        try:
            ds = load_dataset(source, split="train", streaming=cfg.streaming)
        except Exception as e:  # offline, unknown name, gated...: say what to do instead of a deep traceback
            raise ConfigError(f"could not load hub dataset {source!r} ({type(e).__name__}: {e}). Hub datasets need "
                              "network access (HF_DATASETS_OFFLINE unset); offline, point --data at local files.")
    else:
        kwargs = {"sample_by": "document"} if builder == "text" else {}  # one .txt file = one document
        ds = load_dataset(builder, data_files=source, split="train", streaming=cfg.streaming, **kwargs)
    columns = ds.column_names if ds.column_names is not None else list(next(iter(ds)).keys())
    if cfg.text_field not in columns:
        raise ConfigError(f"the data has no {cfg.text_field!r} column (columns: {columns}); set --text_field.")
    if cfg.text_field != "text":
        ds = ds.rename_column(cfg.text_field, "text")
    if cfg.streaming:
        # Held-out documents: the head of the stream; training skips them.
        return ds.skip(cfg.val_docs), ds.take(cfg.val_docs)
    if cfg.val_fraction == 0 or len(ds) < 2:
        return ds, None
    # data_seed, not seed: runs that differ only in --seed are validated on the same documents
    split = ds.train_test_split(test_size=cfg.val_fraction, seed=cfg.data_seed, shuffle=True)
    return split["train"], split["test"]


# ---------------------------------------------------------------------------------------------------------
# Tokenizer: a byte-level BPE trained locally with `tokenizers` (no hub download), or a local one.
# ---------------------------------------------------------------------------------------------------------


def train_tokenizer(texts, vocab_size: int, out_dir: str | os.PathLike):
    """Train a byte-level BPE tokenizer on an iterator of strings and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None)
    fast.model_max_length = 1 << 30
    fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(cfg: TrainConfig, train_texts=None):
    """The run's tokenizer: output_dir/tokenizer if present (resume), else the checkpoint's, a given dir,
    or a freshly trained BPE. Saved into output_dir/tokenizer so the run dir is self-contained."""
    from transformers import AutoTokenizer

    from .tasks import task_of

    task = task_of(cfg)
    run_tok = Path(cfg.output_dir) / "tokenizer"
    if (run_tok / "tokenizer.json").is_file():
        return _check_task_tokenizer(AutoTokenizer.from_pretrained(str(run_tok)), task, run_tok)
    if cfg.tokenizer != "train":
        tok = _check_task_tokenizer(AutoTokenizer.from_pretrained(cfg.tokenizer), task, cfg.tokenizer)
    elif cfg.model is not None and (Path(cfg.model) / "tokenizer.json").is_file():
        tok = _check_task_tokenizer(AutoTokenizer.from_pretrained(cfg.model), task, cfg.model)
    elif task is not None:
        return task.build_tokenizer(run_tok)  # the task's own vocabulary: nothing to learn
    else:
        if train_texts is None:
            raise ConfigError("tokenizer='train' needs the training texts.")
        return train_tokenizer(train_texts, cfg.vocab_size, run_tok)
    if tok.eos_token_id is None:
        raise ConfigError(f"tokenizer {cfg.tokenizer!r} has no eos token; packing needs one to end documents.")
    tok.save_pretrained(str(run_tok))
    return tok


def _check_task_tokenizer(tok, task, where):
    """A generated task's text must be read with exactly the task's vocabulary (a BPE would split 'w17')."""
    if task is not None and tok.get_vocab() != {t: i for i, t in enumerate(task.tokens())}:
        raise ConfigError(f"the tokenizer in {str(where)!r} is not the {task.name} task's vocabulary (with these "
                          "task parameters); use --tokenizer train to build it, or a tokenizer saved by a run of "
                          "the same task.")
    return tok


def tokenizer_training_texts(train_ds, max_chars: int = 20_000_000):
    """Iterator over (a bounded prefix of) the training documents for BPE training."""
    seen = 0
    for row in train_ds:
        text = row["text"]
        if not text:
            continue
        seen += len(text)
        yield text
        if seen >= max_chars:
            return


# ---------------------------------------------------------------------------------------------------------
# Tokenize + pack into fixed-length blocks that remember their document pieces
# ---------------------------------------------------------------------------------------------------------


def pack_token_lists(docs: list[list[int]], seq_len: int) -> dict:
    """Concatenate documents and cut into blocks of exactly seq_len tokens.

    Returns {"input_ids": [[...seq_len]...], "doc_lens": [[len of each document piece in the block]...]}.
    A document that crosses a block edge continues in the next block as a new piece (positions restart).
    The tail that does not fill a block is dropped (at most seq_len - 1 tokens per call).
    """
    blocks, lens = [], []
    cur, cur_lens = [], []
    for ids in docs:
        start = 0
        while start < len(ids):
            take = min(seq_len - len(cur), len(ids) - start)
            cur.extend(ids[start:start + take])
            cur_lens.append(take)
            start += take
            if len(cur) == seq_len:
                blocks.append(cur)
                lens.append(cur_lens)
                cur, cur_lens = [], []
    return {"input_ids": blocks, "doc_lens": lens}


class _TokenizeAndPack:
    """Batched `datasets.map` function (a class so datasets can fingerprint it for its cache)."""

    def __init__(self, tokenizer, seq_len: int):
        self.tokenizer = tokenizer
        self.seq_len = seq_len

    def __call__(self, batch):
        enc = self.tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        return pack_token_lists([ids + [eos] for ids in enc if ids], self.seq_len)


def pack_dataset(ds, tokenizer, cfg: TrainConfig, docs_per_map_batch: int = 1000):
    if ds is None:
        return None
    fn = _TokenizeAndPack(tokenizer, cfg.seq_len)
    cols = ds.column_names
    if cols is None:  # a streamed dataset may not know its columns before reading
        cols = list(next(iter(ds)).keys())
    if cfg.streaming:
        return ds.map(fn, batched=True, batch_size=docs_per_map_batch, remove_columns=cols)
    # An explicit fingerprint: datasets cannot hash a tokenizer reliably, and a cache miss re-tokenizes everything.
    key = json.dumps([ds._fingerprint, tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id, cfg.seq_len,
                      docs_per_map_batch, 1])
    return ds.map(fn, batched=True, batch_size=docs_per_map_batch, remove_columns=cols, num_proc=cfg.num_proc,
                  desc=f"tokenize+pack to {cfg.seq_len}", new_fingerprint=hashlib.sha1(key.encode()).hexdigest())


class PackedCollator:
    """Blocks -> one flattened row in the flash-attention varlen layout, via DataCollatorWithFlattening.

    Output: input_ids/labels/position_ids of shape (1, batch*seq_len), cu_seq_lens_q/k (int32), max_length_q/k.
    """

    def __init__(self):
        from transformers import DataCollatorWithFlattening

        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)

    def __call__(self, blocks):
        pieces = []
        for block in blocks:
            ids = block["input_ids"]
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            doc_lens = block["doc_lens"]
            doc_lens = doc_lens.tolist() if hasattr(doc_lens, "tolist") else list(doc_lens)
            if sum(doc_lens) != len(ids):
                raise ValueError(f"block doc_lens sum {sum(doc_lens)} != block length {len(ids)}")
            start = 0
            for n in doc_lens:
                pieces.append({"input_ids": ids[start:start + n]})
                start += n
        return self.flatten(pieces)


class EpochSampler(torch.utils.data.Sampler):
    """A permutation that depends only on (seed, epoch): data order needs no RNG state to resume exactly."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


def build_dataloaders(cfg: TrainConfig, tokenizer, train_text, val_text):
    """(train_loader, val_loader or None, number of train blocks or None for streaming)."""
    from torch.utils.data import DataLoader

    collate = PackedCollator()
    train = pack_dataset(train_text, tokenizer, cfg)
    val = pack_dataset(val_text, tokenizer, cfg)
    if cfg.streaming:
        train = train.shuffle(seed=cfg.seed, buffer_size=cfg.shuffle_buffer)
        train_dl = DataLoader(train, batch_size=cfg.batch_size, collate_fn=collate, num_workers=cfg.num_workers,
                              drop_last=True)
        n_train = None
    else:
        train = train.with_format(None)
        n_train = len(train)
        if n_train < cfg.batch_size:
            raise ConfigError(f"the training split packs into only {n_train} blocks of {cfg.seq_len} tokens, fewer "
                              f"than --batch_size {cfg.batch_size}; give more data or a smaller --seq_len.")
        train_dl = DataLoader(train, batch_size=cfg.batch_size, sampler=EpochSampler(n_train, cfg.seed),
                              collate_fn=collate, num_workers=cfg.num_workers, drop_last=True)
    val_dl = None
    if val is not None:
        if not cfg.streaming and len(val) == 0:
            # e.g. a 64K stage whose held-out documents add up to less than one block: say so, since every eval
            # step (and the run's final validation CE) would otherwise be missing without a word
            warnings.warn(f"the validation split ({len(val_text)} documents) packs into no block of {cfg.seq_len} "
                          f"tokens, so this run has no evaluation; raise --val_fraction (now {cfg.val_fraction}) or "
                          "give more data", stacklevel=2)
            val = None
        else:
            val_dl = DataLoader(val, batch_size=cfg.batch_size, collate_fn=collate, shuffle=False, drop_last=False)
    return train_dl, val_dl, n_train
