"""Local data for RULER: word lists, the essay haystack and the QA sets.

Nothing here downloads. The essay haystack (Paul Graham essays in RULER) and the QA sets
(SQuAD v2 dev, HotpotQA dev distractor) are read from files the user names, either as
task metadata (``essay_path``, ``squad_path``, ``hotpotqa_path``) or through the
environment variables below. A task whose source is missing raises ``MissingSourceError``
naming the key/variable to set; the CLI turns that into a skip with a clear message.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SOURCE_KEYS = {
    "essay": ("essay_path", "HF_DELTAMATCH_RULER_ESSAYS"),
    "squad": ("squad_path", "HF_DELTAMATCH_RULER_SQUAD"),
    "hotpotqa": ("hotpotqa_path", "HF_DELTAMATCH_RULER_HOTPOTQA"),
}

SOURCE_HELP = {
    "essay": "the essay haystack: RULER's PaulGrahamEssays.json ({\"text\": ...}), a .txt/.jsonl file "
             "or a directory of .txt essays",
    "squad": "SQuAD v2 dev set JSON (dev-v2.0.json)",
    "hotpotqa": "HotpotQA dev distractor JSON (hotpot_dev_distractor_v1.json)",
}


class MissingSourceError(FileNotFoundError):
    """A RULER task needs a local file that was not given or does not exist."""

    def __init__(self, source: str, detail: str):
        key, env = SOURCE_KEYS[source]
        super().__init__(
            f"RULER needs {SOURCE_HELP[source]} ({detail}). Nothing is downloaded: point to a local "
            f"copy with --metadata {key}=/path/to/file (or model_args), or set ${env}."
        )
        self.source = source


def resolve_source(source: str, metadata: dict | None) -> Path:
    """Path of a local source from metadata or environment, or MissingSourceError."""
    key, env = SOURCE_KEYS[source]
    value = (metadata or {}).get(key) or os.environ.get(env)
    if not value:
        raise MissingSourceError(source, f"neither `{key}` nor ${env} is set")
    path = Path(str(value)).expanduser()
    if not path.exists():
        raise MissingSourceError(source, f"{path} does not exist")
    return path


def missing_sources(needs: tuple[str, ...], metadata: dict | None) -> list[str]:
    """Messages for each source in ``needs`` that cannot be resolved (empty if all present)."""
    out = []
    for source in needs:
        try:
            resolve_source(source, metadata)
        except MissingSourceError as e:
            out.append(str(e))
    return out


# --------------------------------------------------------------------------- words


@lru_cache(maxsize=1)
def _wonderwords_categories() -> dict[str, list[str]]:
    try:
        import wonderwords
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "RULER's needle keys and CWE words come from `wonderwords`; "
            "install it with `pip install 'hf-deltamatch[eval]'` (or `pip install wonderwords`)."
        ) from e
    cats = wonderwords.RandomWord()._categories
    return {"nouns": list(cats["nouns"]), "adjectives": list(cats["adjectives"]), "verbs": list(cats["verbs"])}


@lru_cache(maxsize=1)
def _needle_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    c = _wonderwords_categories()
    return tuple(sorted(set(c["adjectives"]))), tuple(sorted(set(c["nouns"])))


def num_needle_words() -> int:
    adjs, nouns = _needle_parts()
    return len(adjs) * len(nouns)


def needle_word(i: int) -> str:
    """The i-th of RULER's needle keys: adjective-noun pairs (~6M of them).

    RULER materialises and sorts every pair; indexing the product directly gives the same
    uniform choice without building a 6M-string list.
    """
    adjs, nouns = _needle_parts()
    return f"{adjs[i // len(nouns)]}-{nouns[i % len(nouns)]}"


@lru_cache(maxsize=1)
def cwe_words() -> tuple[str, ...]:
    """CWE vocabulary: nouns, adjectives and verbs, shuffled with RULER's fixed seed."""
    import random

    c = _wonderwords_categories()
    words = sorted({w for k in ("nouns", "adjectives", "verbs") for w in c[k]})
    random.Random(42).shuffle(words)
    return tuple(words)


# --------------------------------------------------------------------------- essays


@lru_cache(maxsize=4)
def load_essay_words(path: str) -> tuple[str, ...]:
    """The essay haystack as a word list, whitespace-normalised as RULER does."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.txt"))
        if not files:
            raise MissingSourceError("essay", f"directory {p} has no .txt files")
        text = "\n".join(f.read_text(encoding="utf-8") for f in files)
    elif p.suffix == ".jsonl":
        rows = [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        text = " ".join(r["text"] for r in rows)
    elif p.suffix == ".json":
        data = json.loads(p.read_text(encoding="utf-8"))
        text = data["text"] if isinstance(data, dict) else " ".join(
            d["text"] if isinstance(d, dict) else str(d) for d in data)
        if isinstance(text, list):
            text = " ".join(text)
    else:
        text = p.read_text(encoding="utf-8")
    words = re.sub(r"\s+", " ", text).strip().split(" ")
    words = [w for w in words if w]
    if len(words) < 50:
        raise MissingSourceError("essay", f"{p} holds only {len(words)} words")
    return tuple(words)


# A sentence ends at . ! or ? (plus closing quotes/brackets) before whitespace and a capital or digit.
_SENT_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s+[\"'\u201c\u2018(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentence split used to place needles at sentence boundaries.

    RULER uses NLTK's punkt model, which needs a data download; this rule-based splitter needs
    nothing and only decides *where* needles may go, not what the haystack contains. Joining
    the pieces with single spaces gives back the (whitespace-normalised) text.
    """
    text = text.strip()
    out, start = [], 0
    for m in _SENT_END.finditer(text):
        out.append(text[start:m.end()].strip())
        start = m.end()
    out.append(text[start:].strip())
    return [s for s in out if s]


# --------------------------------------------------------------------------- QA sets


@lru_cache(maxsize=4)
def read_squad(path: str) -> tuple[list[dict], list[str]]:
    """SQuAD (v2 dev format; v1 works too): answerable questions, deduplicated paragraphs.

    Same construction as RULER's qa.py: each question keeps its own paragraph as gold
    context and the other paragraphs of its article as preferred distractors.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "data" not in data:
        raise ValueError(f"{path} is not a SQuAD JSON file (expected a top-level 'data' list)")
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    doc_idx = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [doc_idx[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            own = doc_idx[p["context"]]
            for qa in p["qas"]:
                if qa.get("is_impossible", False) or not qa.get("answers"):
                    continue
                qas.append({
                    "query": qa["question"],
                    "outputs": [a["text"] for a in qa["answers"]],
                    "context": [own],
                    "more_context": [i for i in more if i != own],
                })
    return qas, docs


@lru_cache(maxsize=4)
def read_hotpotqa(path: str) -> tuple[list[dict], list[str]]:
    """HotpotQA dev (distractor): each question's ten paragraphs are its gold context."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, list) or (data and "context" not in data[0]):
        raise ValueError(f"{path} is not a HotpotQA JSON file (expected a list of questions with 'context')")
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    doc_idx = {c: i for i, c in enumerate(docs)}
    qas = [{
        "query": d["question"],
        "outputs": [d["answer"]],
        "context": [doc_idx[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
    } for d in data]
    return qas, docs


@dataclass
class LoadedQA:
    qas: list[dict]
    docs: list[str]


def load_qa(dataset: str, metadata: dict | None) -> LoadedQA:
    path = resolve_source(dataset, metadata)
    qas, docs = (read_squad if dataset == "squad" else read_hotpotqa)(str(path))
    if not qas:
        raise ValueError(f"{path} has no answerable questions")
    return LoadedQA(qas, docs)
