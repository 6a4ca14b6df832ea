"""Tiny offline assets for the eval tests: a byte-level BPE tokenizer (8k vocab) trained
here, a 2-layer Llama with head_dim 32, and small files in the formats RULER's essay
haystack and QA sets use. Nothing is downloaded."""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

VOCAB_SIZE = 8192


def _corpus() -> list[str]:
    import wonderwords

    cats = wonderwords.RandomWord()._categories
    words = sorted(set(cats["nouns"]) | set(cats["adjectives"]) | set(cats["verbs"]))
    rng = random.Random(0)
    lines = [" ".join(rng.sample(words, 12)) + "." for _ in range(3000)]
    # Real prose too, so punctuation/capitals merge sensibly: docstrings of the stdlib.
    import collections, json as _json, random as _random, string as _string, textwrap  # noqa: E401
    for mod in (collections, _json, _random, _string, textwrap, inspect):
        for _, obj in inspect.getmembers(mod):
            doc = inspect.getdoc(obj)
            if doc:
                lines += doc.splitlines()
    lines += [f"{rng.randint(10**6, 10**7 - 1)} {rng.randint(10000, 99999)} VAR {w.upper()[:5]}"
              for w in rng.sample(words, 2000)]
    return lines


def build_tokenizer(out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", model_max_length=1 << 20)
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: Path, vocab_size: int, max_positions: int = 8192) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(out_dir)


def write_essay(path: Path, n_words: int = 3000) -> Path:
    """A RULER-format essay file (PaulGrahamEssays.json: {"text": ...}) of plain sentences."""
    import wonderwords

    nouns = sorted(wonderwords.RandomWord()._categories["nouns"])
    rng = random.Random(1)
    sents, count = [], 0
    while count < n_words:
        k = rng.randint(6, 14)
        ws = rng.sample(nouns, k)
        sents.append(ws[0].capitalize() + " " + " ".join(ws[1:]) + ".")
        count += k
    path.write_text(json.dumps({"text": " ".join(sents)}))
    return path


def write_squad(path: Path, n_articles: int = 30, paras: int = 4) -> Path:
    """SQuAD v2 dev-format JSON: answerable and impossible questions, each answerable one with two
    references. ~6K tokens of paragraphs, enough to fill a 4K budget with distractors."""
    import wonderwords

    nouns = sorted(wonderwords.RandomWord()._categories["nouns"])
    rng = random.Random(2)
    data = []
    for a in range(n_articles):
        ps = []
        for p in range(paras):
            city = f"Town{a}x{p}"
            filler = " ".join(rng.sample(nouns, 25))
            ctx = f"The river of {city} is long. People in {city} grow {rng.choice(['rice', 'wheat', 'corn'])}. " \
                  f"Locals list {filler}."
            qas = [{"question": f"Which town is paragraph {a}-{p} about?", "id": f"{a}-{p}",
                    "answers": [{"text": city, "answer_start": ctx.index(city)},
                                {"text": f"the town {city}", "answer_start": 0}],
                    "is_impossible": False},
                   {"question": f"Who founded {city}?", "id": f"{a}-{p}-x", "answers": [],
                    "plausible_answers": [], "is_impossible": True}]
            ps.append({"context": ctx, "qas": qas})
        data.append({"title": f"Article {a}", "paragraphs": ps})
    path.write_text(json.dumps({"version": "v2.0", "data": data}))
    return path


def write_hotpotqa(path: Path, n: int = 60) -> Path:
    """HotpotQA dev-distractor-format JSON (list of questions, each with [title, sentences] context)."""
    rng = random.Random(3)
    rows = []
    for i in range(n):
        weights = [rng.randint(100, 999) for _ in range(4)]
        ctx = [[f"Title {i}-{j}", [f"Sentence about item {i}-{j}. ", f"It weighs {weights[j]} kg."]]
               for j in range(4)]
        rows.append({"_id": str(i), "question": f"How heavy is item {i}-0?", "answer": f"{weights[0]} kg",
                     "type": "bridge", "level": "easy", "supporting_facts": [[f"Title {i}-0", 1]], "context": ctx})
    path.write_text(json.dumps(rows))
    return path


def write_run_dir(run_dir: Path, model_src: Path | None = None) -> Path:
    """A training run directory as recipes/pretrain.py leaves it (config.yaml, metrics.jsonl,
    summary.json, final/config.json)."""
    import shutil

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(
        "model: null\nattn: deltamatch_fp8\nprecision: fp8\ndelta: matching\ndata: stdlib\nseq_len: 256\n"
        "batch_size: 8\ngrad_accum: 1\noptimizer: adamw\nlr: 0.003\nwarmup_steps: 20\nmax_steps: 40\n"
        "mixed_precision: bf16\nseed: 0\noutput_dir: runs/tiny-test\n")
    recs, tokens = [], 0
    for step in range(5, 45, 5):
        tokens += 5 * 8 * 256
        recs.append({"kind": "train", "step": step, "tokens": tokens, "loss": 8.0 - step / 10, "lr": 0.003,
                     "grad_norm": 1.0, "tokens_per_s": 1000.0, "mem_gb": 0.1, "elapsed_s": step})
        if step % 20 == 0:
            recs.append({"kind": "eval", "step": step, "tokens": tokens, "val_loss": 8.1 - step / 10})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run_dir / "summary.json").write_text(json.dumps({
        "name": "tiny-test", "steps": 40, "tokens": tokens, "elapsed_s": 40.0, "final_val_loss": 4.1,
        "attn": "deltamatch_fp8", "precision": "fp8", "delta": "matching", "interrupted": False, "params": 123456,
        "trainable_params": 123456, "final_train_loss": 4.0, "first_train_loss": 7.5, "tokens_per_s": 1000.0}))
    final = run_dir / "final"
    if model_src is not None:
        shutil.copytree(model_src, final, dirs_exist_ok=True)
    else:
        final.mkdir(exist_ok=True)
        (final / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 8192,
            "max_position_embeddings": 8192}))
    return run_dir


def fake_cached_hub_dataset(cache_dir: Path, repo: str, config: str, splits: dict[str, list[dict]]) -> None:
    """Put a dataset into a `datasets` cache as if `load_dataset(repo, config)` had run online, so offline
    loading finds it ("Using the latest cached version..."). Built from local rows; nothing is fetched."""
    import shutil

    import datasets

    work = cache_dir / "_build"
    files = {}
    for split, rows in splits.items():
        files[split] = str(work / f"{split}.parquet")
        work.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list(rows).to_parquet(files[split])
    builder = datasets.load_dataset_builder("parquet", data_files=files, cache_dir=str(work / "cache"))
    builder.download_and_prepare()
    src = Path(builder.cache_dir)
    namespace, name = repo.split("/")
    dst = cache_dir / f"{namespace}___{name}" / config / src.parts[-2] / src.parts[-1]
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for f in dst.glob("parquet-*.arrow"):  # arrow files are named after the builder
        f.rename(f.with_name(f.name.replace("parquet-", f"{name}-", 1)))
    info = json.loads((dst / "dataset_info.json").read_text())
    info.update(config_name=config, dataset_name=name, builder_name=name)
    (dst / "dataset_info.json").write_text(json.dumps(info))
    shutil.rmtree(work)
