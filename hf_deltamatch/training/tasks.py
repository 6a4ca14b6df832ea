"""Synthetic tasks generated offline: `data: bigram_backcopy` in a recipe config, its parameters under `task:`.

Bigram-Backcopy (Guo et al. 2024, "Active-Dormant Attention Heads: Mechanistically Demystifying Extreme-Token
Phenomena in LLMs", arXiv:2410.13835): a task on which small transformers grow an attention sink on the
beginning-of-sequence token within a few hundred to a few thousand steps. Every sequence is

    <bos> w_1 w_2 ... w_L              (then the packer's <|endoftext|>, so a sequence fills one seq_len block)

over `vocab` ordinary tokens `w0..w{vocab-1}` and `triggers` trigger tokens `T0..T{triggers-1}`:
  - after an ordinary token, the next one is a trigger (uniform among them) with probability `trigger_p`, else
    drawn from a fixed random bigram chain (each row of its transition matrix a Dirichlet(`alpha`) draw);
  - after a trigger, the next token copies the token before the trigger ("a T a"), and the chain continues
    from it. w_1 is uniform, and no sequence starts or ends with a trigger.
Predicting a copy needs attention (to the token before the trigger); predicting a bigram step needs none. So
attention has work on few queries, and a head with nothing to do parks its attention on <bos>, the one key every
query sees: the sink. The sink key is the first token of each document, which is what `--attn_stats` and
`hf-deltamatch check --model` measure as sink mass.

Validation reports, beside the cross-entropy over all tokens, the task's accuracy: top-1 accuracy of the
copy targets (the token after each trigger, the one deterministic prediction), and their cross-entropy.

Everything is a function of `data_seed` and the parameters: the chain, the training and the validation sequences
(three independent streams of numpy's default Generator), written once as JSON lines under
$HF_DELTAMATCH_CACHE/tasks/ and read from there by every run, so runs that differ only in `--seed` train on the same
data and validate on the same sequences. (numpy does not promise the same draws across its versions: the sinks
study records the validation file's hash.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

from .config import ConfigError

BOS = "<bos>"
EOS = "<|endoftext|>"  # the recipes' end-of-document token (data.EOS): the packer appends it to every sequence


@dataclasses.dataclass(frozen=True)
class BigramBackcopy:
    vocab: int = 64  # ordinary tokens w0..w{vocab-1}
    triggers: int = 3  # trigger tokens T0..T{triggers-1}
    trigger_p: float = 0.1  # probability that a trigger follows an ordinary token
    alpha: float = 0.1  # Dirichlet concentration of each bigram row (small: peaked, learnable transitions)
    train_sequences: int = 20_000
    val_sequences: int = 256

    name = "bigram_backcopy"

    def __post_init__(self):
        err = []
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), (int,) if f.type == "int" else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind):
                err.append(f"task.{f.name} must be {'an integer' if f.type == 'int' else 'a number'}, got {value!r}")
        if err:
            raise ConfigError("; ".join(err) + ".")
        if self.vocab < 2:
            err.append(f"task.vocab must be at least 2, got {self.vocab}")
        if self.triggers < 1:
            err.append(f"task.triggers must be at least 1, got {self.triggers}")
        if not 0 < self.trigger_p < 1:
            err.append(f"task.trigger_p must be in (0, 1), got {self.trigger_p}")
        if self.alpha <= 0:
            err.append(f"task.alpha must be > 0, got {self.alpha}")
        if self.train_sequences < 1 or self.val_sequences < 1:
            err.append("task.train_sequences and task.val_sequences must be positive")
        if err:
            raise ConfigError("; ".join(err) + ".")

    # -- vocabulary ----------------------------------------------------------------------------------------
    def tokens(self) -> list[str]:
        """Token strings in id order: EOS, BOS, the triggers, the ordinary tokens."""
        return [EOS, BOS] + [f"T{i}" for i in range(self.triggers)] + [f"w{i}" for i in range(self.vocab)]

    def trigger_tokens(self) -> list[str]:
        return [f"T{i}" for i in range(self.triggers)]

    def build_tokenizer(self, out_dir: str | os.PathLike | None = None):
        """A word-level tokenizer over exactly `tokens()` (nothing learned); saved to out_dir if given."""
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {t: i for i, t in enumerate(self.tokens())}
        # unk_token outside the vocabulary: a word the task does not have fails to encode instead of mapping to 0
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS)
        fast.model_max_length = 1 << 30
        if out_dir is not None:
            fast.save_pretrained(str(out_dir))
        return fast

    # -- generation ----------------------------------------------------------------------------------------
    def transitions(self, seed: int) -> np.ndarray:
        """(vocab, vocab) bigram transition matrix of the ordinary tokens."""
        rng = np.random.default_rng([seed, 0])
        return rng.dirichlet(np.full(self.vocab, self.alpha), size=self.vocab)

    def generate(self, n: int, length: int, seed: int, stream: int) -> np.ndarray:
        """(n, length) sequences after <bos>, as indices: 0..vocab-1 ordinary, vocab + i trigger T{i}."""
        if length < 1:
            raise ConfigError(f"bigram_backcopy needs seq_len >= 3 (<bos>, a token, <|endoftext|>), got {length + 2}.")
        cum = np.cumsum(self.transitions(seed), axis=1)
        cum[:, -1] = 1.0  # rounding: the last entry must catch every u < 1
        rng = np.random.default_rng([seed, stream])
        out = np.empty((n, length), dtype=np.int64)
        last = rng.integers(self.vocab, size=n)  # the latest ordinary token
        out[:, 0] = last
        after_trigger = np.zeros(n, dtype=bool)
        for t in range(1, length):
            u, coin = rng.random(n), rng.random(n)
            which = rng.integers(self.triggers, size=n)
            bigram = (cum[last] < u[:, None]).sum(axis=1)
            trigger = ~after_trigger & (coin < self.trigger_p) & (t < length - 1)
            # after a trigger: the token before it (always ordinary, so `last`); the chain then goes on from there
            nxt = np.where(after_trigger, last, np.where(trigger, self.vocab + which, bigram))
            out[:, t] = nxt
            last = np.where(trigger, last, nxt)
            after_trigger = trigger
        return out

    def documents(self, n: int, seq_len: int, seed: int, stream: int) -> list[str]:
        """Sequences as text: '<bos> w.. T.. w..', seq_len - 1 tokens each (the packer adds the end token)."""
        names = np.array([f"w{i}" for i in range(self.vocab)] + self.trigger_tokens())
        seqs = self.generate(n, seq_len - 2, seed, stream)
        return [BOS + " " + " ".join(row) for row in names[seqs]]

    def build(self, cache_root: str | os.PathLike, seq_len: int, seed: int) -> tuple[Path, Path]:
        """Write train.jsonl and val.jsonl once under cache_root/<name>-<hash of everything>/; return both."""
        spec = {"task": self.name, **dataclasses.asdict(self), "seq_len": seq_len, "seed": seed, "format": 1}
        key = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
        root = Path(cache_root) / f"{self.name}-{key}"
        train, val = root / "train.jsonl", root / "val.jsonl"
        if not (train.is_file() and val.is_file()):
            root.mkdir(parents=True, exist_ok=True)
            (root / "task.json").write_text(json.dumps(spec, indent=1))
            for path, n, stream in ((val, self.val_sequences, 2), (train, self.train_sequences, 1)):
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                with tmp.open("w", encoding="utf-8") as f:
                    for doc in self.documents(n, seq_len, seed, stream):
                        f.write(json.dumps({"text": doc}) + "\n")
                os.replace(tmp, path)  # atomic: a concurrent run never reads half a file
        return train, val

    # -- evaluation ------------------------------------------------------------------------------------------
    def scored_positions(self, input_ids: torch.Tensor, tokenizer) -> torch.Tensor:
        """Bool mask of the positions whose next token is a copy target (the positions holding a trigger)."""
        ids = torch.tensor(tokenizer.convert_tokens_to_ids(self.trigger_tokens()), device=input_ids.device)
        return torch.isin(input_ids, ids)


TASKS = {BigramBackcopy.name: BigramBackcopy}


def is_task(data) -> bool:
    return isinstance(data, str) and data in TASKS


def task_of(cfg):
    """The task object of a config (`data` names a task, `task` holds its parameters), or None."""
    if not is_task(cfg.data):
        return None
    params = cfg.task or {}
    if not isinstance(params, dict):
        raise ConfigError(f"--task must be a mapping of {cfg.data} parameters, got {params!r}.")
    cls = TASKS[cfg.data]
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(f"task: unknown {cfg.data} parameter(s) {unknown}; valid: {known}.")
    return cls(**params)


def prepare(cfg) -> dict:
    """What a run of `cfg` reads, made ahead of it: the task's sequences (cache), its tokenizer in
    output_dir/tokenizer, and both splits tokenized and packed into the datasets cache. Runs started afterwards with
    `--tokenizer output_dir/tokenizer` and the same data settings find everything made (parallel runs then do not
    each generate and tokenize it). Returns the paths."""
    from transformers import AutoTokenizer

    from .data import default_cache_root, load_text_splits, pack_dataset

    task = task_of(cfg)
    if task is None:
        raise ConfigError(f"--data {cfg.data!r} is not a generated task; choose one of {sorted(TASKS)}.")
    train, val = task.build(default_cache_root() / "tasks", cfg.seq_len, cfg.data_seed)
    tok_dir = Path(cfg.output_dir) / "tokenizer"
    task.build_tokenizer(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))  # as the runs will load it (the same cache key)
    train_text, val_text = load_text_splits(cfg)
    pack_dataset(train_text, tokenizer, cfg)
    pack_dataset(val_text, tokenizer, cfg)
    return {"train": str(train), "val": str(val), "task": str(train.parent / "task.json"), "tokenizer": str(tok_dir)}


def main(argv: list[str] | None = None) -> int:
    """python -m hf_deltamatch.training.tasks --config CFG [recipe flags]: prepare() and print its paths, with the
    config's seq_len and max_steps (one JSON line)."""
    from .config import parse_config

    try:
        cfg = parse_config(argv, description="Generate a task's data, tokenizer and packed blocks ahead of its runs; "
                                             "prints their paths, seq_len and max_steps as JSON.")
        print(json.dumps({**prepare(cfg), "seq_len": cfg.seq_len, "max_steps": cfg.max_steps}))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
