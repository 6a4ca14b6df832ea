"""RULER sample generation, sized with the evaluated model's tokenizer.

Follows NVIDIA/RULER's generators (niah.py, variable_tracking.py,
common_words_extraction.py, freq_words_extraction.py, qa.py) with two deliberate changes:

* Budgets are exact: every sample satisfies
  ``len(tokenizer(prompt).input_ids) + tokens_to_generate <= max_seq_length`` where
  ``prompt`` is the exact string lm-eval feeds the model (``input + " " + gen_prefix``).
  The haystack size is found by exponential + binary search instead of fixed increments
  (fewer tokenizer passes at 128K), then shrunk per sample until it fits.
  (RULER's FWE could overshoot by ``tokens_to_generate``; here it cannot.)
* Randomness is local: each sample draws from ``random.Random(f"{seed}:{task}:{length}:{i}")``,
  so any sample is reproducible on its own and independent of global RNG state.
"""

from __future__ import annotations

import logging
import random
import re
import string
import uuid
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from . import constants as C
from .sources import (
    cwe_words,
    load_essay_words,
    load_qa,
    needle_word,
    num_needle_words,
    resolve_source,
    split_sentences,
)

log = logging.getLogger(__name__)

# Needle depths in percent, as RULER: 40 evenly spaced positions over [0, 100].
DEPTHS = [round(100 * i / 39) for i in range(40)]

Sample = tuple[str, str, list[str]]  # (input, gen_prefix, outputs)
Builder = Callable[[random.Random, int, int], Sample]


def prompt_text(input_text: str, gen_prefix: str) -> str:
    """The exact prompt lm-eval builds from ``doc_to_text`` and ``gen_prefix`` (no chat template)."""
    return f"{input_text} {gen_prefix}"


class TokenCounter:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> int:
        # verbose=False: prompts are longer than model_max_length on purpose while probing.
        return len(self.tokenizer(text, verbose=False)["input_ids"])


# --------------------------------------------------------------------------- random values


def _rand_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # 7 digits, as RULER
    if kind == "words":
        return needle_word(rng.randrange(num_needle_words()))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


# --------------------------------------------------------------------------- NIAH


def _niah_builder(task: C.RulerTask, metadata: dict | None) -> tuple[Builder, int, int]:
    a = task.args
    hay, tk, tv = a["type_haystack"], a["type_needle_k"], a["type_needle_v"]
    num_q = a["num_needle_q"]
    num_k = max(a["num_needle_k"], num_q)
    num_v = a["num_needle_v"]
    essay = load_essay_words(str(resolve_source("essay", metadata))) if hay == "essay" else None
    warned = []

    def build(rng: random.Random, n: int, index: int) -> Sample:
        keys: list[str] = []
        values: list[list[str]] = []
        needles: list[str] = []
        while len(keys) < num_k:
            k = _rand_value(rng, tk)
            if k in keys:
                continue
            keys.append(k)
            vals = [_rand_value(rng, tv) for _ in range(num_v)]
            values.append(vals)
            needles += [C.NEEDLE.format(type_needle_v=tv, key=k, value=v) for v in vals]
        rng.shuffle(needles)

        if hay == "essay":
            # Cycle a short essay file rather than fail; the real RULER corpus is long enough.
            if n > len(essay) and not warned:
                warned.append(True)
                log.warning("essay haystack has %d words; repeating it to fill %d words (RULER's essay set "
                            "is ~100K words)", len(essay), n)
            words = [essay[i % len(essay)] for i in range(n)]
            sents = split_sentences(" ".join(words))
            cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(p for p in parts if p)
        else:
            if hay == "noise":
                sentences = [C.NOISE] * n
            else:  # "needle": distractor needles with fresh keys (never a queried key)
                sentences = []
                while len(sentences) < n:
                    k = _rand_value(rng, tk)
                    if k not in keys:
                        sentences.append(C.NEEDLE.format(type_needle_v=tv, key=k, value=_rand_value(rng, tv)))
            for pos, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
                sentences.insert(pos, needle)
            context = "\n".join(sentences)

        idx = rng.sample(range(num_k), num_q)
        queries = [keys[i] for i in idx]
        answers = [v for i in idx for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

        template, prefix, type_v = C.NIAH_TEMPLATE, C.NIAH_ANSWER_PREFIX, tv
        if num_q * num_v == 1:  # RULER's singular rewrite of the template and answer prefix
            def single(s: str) -> str:
                return (s.replace("Some", "A").replace("are all", "is").replace("are", "is")
                        .replace("answers", "answer"))
            template, prefix, type_v = single(template), single(prefix), tv[:-1]
        return (template.format(type_needle_v=type_v, context=context, query=query),
                prefix.format(type_needle_v=type_v, query=query), answers)

    return build, num_k * num_v, 10**9


# --------------------------------------------------------------------------- variable tracking


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, is_icl: bool):
    k = 3 if is_icl else 5
    num_hops = min(10, num_hops) if is_icl else num_hops
    need = (num_hops + 1) * num_chains
    names: list[str] = []
    while len(names) < need:  # distinct variable names
        v = "".join(rng.choices(string.ascii_uppercase, k=k))
        if v not in names and v != "VAR":  # "VAR" would collide with the assignment keyword
            names.append(v)
    vars_ret, chains = [], []
    for i in range(0, need, num_hops + 1):
        vs = names[i:i + num_hops + 1]
        vars_ret.append(vs)
        chain = [f"VAR {vs[0]} = {rng.randint(10000, 99999)}"]
        chain += [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(num_hops)]
        chains.append(chain)
    return vars_ret, chains


def _vt_sample(rng: random.Random, n: int, num_chains: int, num_hops: int, is_icl: bool):
    vars_, chains = _vt_chains(rng, num_chains, num_hops, is_icl)
    sentences = [C.NOISE + "\n"] * n
    for chain in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, pos in enumerate(positions):
            sentences.insert(pos + j, chain[j])
    context = " ".join(sentences).replace(". \n", ".\n")
    value = chains[0][0].split("=")[-1].strip()
    num_v = len(vars_[0])
    return (C.VT_TEMPLATE.format(context=context, query=value),
            C.VT_ANSWER_PREFIX.format(num_v=num_v, query=value), vars_[0])


def _vt_builder(task: C.RulerTask, count: TokenCounter, seed: int) -> tuple[Builder, int, int]:
    nc, nh = task.args["num_chains"], task.args["num_hops"]
    # RULER prepends one solved example, generated to fit 500 tokens.
    icl_rng_seed = f"{seed}:vt:icl"
    icl_fit = _fit_size(
        lambda n: count(_join_icl(*_vt_sample(random.Random(icl_rng_seed), n, nc, nh, True))) <= 500,
        lo=nh + 1, hi=10**6, start=5)
    if icl_fit is None:
        raise ValueError("tokenizer cannot fit RULER's variable-tracking example in 500 tokens")
    icl = _join_icl(*_vt_sample(random.Random(icl_rng_seed), icl_fit, nc, nh, True))
    icl_answer_vars = icl.rsplit(":", 1)[1].split()

    def build(rng: random.Random, n: int, index: int) -> Sample:
        example = icl
        for v in icl_answer_vars:  # fresh names per sample, as RULER's randomize_icl
            example = re.sub(rf"\b{v}\b", "".join(rng.choices(string.ascii_uppercase, k=len(v))), example)
        inp, prefix, answer = _vt_sample(rng, n, nc, nh, False)
        return example + "\n\n" + inp, prefix, answer

    return build, nh + 1, 10**9


def _join_icl(inp: str, prefix: str, answer: list[str]) -> str:
    return f"{inp} {prefix} {' '.join(answer)}"


# --------------------------------------------------------------------------- CWE


def _cwe_builder(task: C.RulerTask, max_seq_length: int) -> tuple[Builder, int, int]:
    a = task.args
    words = cwe_words()
    num_cw = a["num_cw"]

    def example(rng: random.Random, num_words: int, cr: int, ur: int):
        pick = rng.sample(words, num_words)
        common, uncommon = pick[:num_cw], pick[num_cw:]
        lst = common * cr + uncommon * ur
        rng.shuffle(lst)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst)), common

    def build(rng: random.Random, n: int, index: int) -> Sample:
        # RULER lowers the repeat counts below 4K so the list can hold enough distinct words.
        if max_seq_length < 4096:
            ex_ctx, ex_ans = example(rng, 20, 3, 1)
            ctx, ans = example(rng, n, 6, 1)
        else:
            ex_ctx, ex_ans = example(rng, 40, 10, 3)
            ctx, ans = example(rng, n, a["freq_cw"], a["freq_ucw"])
        shot = (C.CWE_TEMPLATE.format(context=ex_ctx) + " " + C.CWE_ANSWER_PREFIX + " "
                + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_ans)))
        return shot + "\n" + C.CWE_TEMPLATE.format(context=ctx), C.CWE_ANSWER_PREFIX, ans

    return build, num_cw + 1, len(words)


# --------------------------------------------------------------------------- FWE


def _zeta(alpha: float) -> float:
    try:
        from scipy.special import zeta
        return float(zeta(alpha))
    except ImportError:  # Riemann zeta by direct sum + integral tail; alpha > 1
        n = 10000
        return sum(k ** -alpha for k in range(1, n)) + n ** (1 - alpha) / (alpha - 1)


def _fwe_builder(task: C.RulerTask, max_seq_length: int) -> tuple[Builder, int, int]:
    alpha, wl = task.args["alpha"], task.args["coded_wordlen"]
    vocab_size = max(max_seq_length // 50, 10)  # RULER: max_seq_length // 50
    z = _zeta(alpha)

    def build(rng: random.Random, n: int, index: int) -> Sample:
        vocab: set[str] = set()
        while len(vocab) < vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=wl)))
        voc = sorted(vocab)
        rng.shuffle(voc)
        voc[0] = "..."  # the most frequent "word" is noise, as in RULER
        words = [w for k, w in enumerate(voc, start=1) for _ in range(int(n * k ** -alpha / z))]
        rng.shuffle(words)
        return C.FWE_TEMPLATE.format(context=" ".join(words)), C.FWE_ANSWER_PREFIX, voc[1:4]

    # Below ~60 words the Zipf counts of ranks 2-5 can tie and the answer is ambiguous.
    return build, 60, 10**9


# --------------------------------------------------------------------------- QA


def _qa_builder(task: C.RulerTask, metadata: dict | None):
    data = load_qa(task.args["dataset"], metadata)
    qas, docs = data.qas, data.docs

    def build(rng: random.Random, n: int, index: int) -> Sample:
        q = qas[index]
        gold, more = q["context"], q.get("more_context", [])
        if n < len(docs):
            if n - len(gold) > len(more):
                gold_set = set(gold) | set(more)
                others = [i for i in range(len(docs)) if i not in gold_set]
                chosen = gold + more + rng.sample(others, min(len(others), max(0, n - len(gold) - len(more))))
            else:
                chosen = gold + rng.sample(more, max(0, n - len(gold)))
            chosen_docs = [docs[i] for i in chosen]
        else:
            chosen_docs = list(docs)
        rng.shuffle(chosen_docs)
        ctx = "\n\n".join(C.QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(chosen_docs))
        return C.QA_TEMPLATE.format(context=ctx, query=q["query"]), C.QA_ANSWER_PREFIX, list(q["outputs"])

    return build, qas, len(docs)


# --------------------------------------------------------------------------- fitting


def _fit_size(fits: Callable[[int], bool], lo: int, hi: int, start: int) -> int | None:
    """Largest n in [lo, hi] with fits(n), assuming fits is monotone; None if even lo fails."""
    if not fits(lo):
        return None
    good, n = lo, max(start, lo + 1)
    bad = None
    while n <= hi:  # grow geometrically until the budget is exceeded
        if fits(n):
            good, n = n, n * 2
        else:
            bad = n
            break
    if bad is None:
        if good == hi or fits(hi):
            return hi
        bad = hi
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


def generate_samples(
    task_name: str,
    tokenizer: Any,
    max_seq_length: int,
    num_samples: int = C.NUM_SAMPLES,
    seed: int = C.RANDOM_SEED,
    metadata: dict | None = None,
    progress: bool = True,
) -> list[dict]:
    """Generate ``num_samples`` RULER samples of ``task_name`` at ``max_seq_length`` tokens.

    Each record: ``index, input, gen_prefix, outputs, length, max_length, task, metric``
    where ``length`` = prompt tokens + tokens to generate (always <= ``max_seq_length``).
    Raises ``MissingSourceError`` if the task needs a local file that is not given.
    """
    if task_name not in C.TASKS:
        raise KeyError(f"unknown RULER task {task_name!r}; choose from {', '.join(C.TASK_NAMES)}")
    task = C.TASKS[task_name]
    count = TokenCounter(tokenizer)
    ttg = task.tokens_to_generate
    budget = max_seq_length - ttg

    qas = None
    if task.kind == "niah":
        build, lo, hi = _niah_builder(task, metadata)
    elif task.kind == "vt":
        build, lo, hi = _vt_builder(task, count, seed)
    elif task.kind == "cwe":
        build, lo, hi = _cwe_builder(task, max_seq_length)
    elif task.kind == "fwe":
        build, lo, hi = _fwe_builder(task, max_seq_length)
    else:
        build, qas, hi = _qa_builder(task, metadata)
        lo = 1
        if num_samples > len(qas):
            log.warning("%s: only %d answerable questions in the QA file; generating %d samples instead of %d",
                        task_name, len(qas), len(qas), num_samples)
            num_samples = len(qas)
    hi = min(hi, max_seq_length)  # every haystack unit costs at least one token

    def rng_for(i: int) -> random.Random:
        return random.Random(f"{seed}:{task_name}:{max_seq_length}:{i}")

    def tokens(s: Sample) -> int:
        return count(prompt_text(s[0], s[1]))

    # Size the haystack on a probe sample (RULER sizes on its first sample too).
    probe_lo = len(qas[0]["context"]) if qas else lo
    size = _fit_size(lambda n: tokens(build(rng_for(-1), n, 0)) <= budget, probe_lo, hi,
                     start=max(probe_lo + 1, 8))
    if size is None:
        raise ValueError(
            f"RULER {task_name}: max_seq_length={max_seq_length} leaves no room for the template, "
            f"the needles and {ttg} generated tokens with this tokenizer; use a longer length.")

    out, skipped = [], 0
    for i in tqdm(range(num_samples), desc=f"RULER {task_name} @ {max_seq_length}", disable=not progress,
                  leave=False):
        n = size
        floor = len(qas[i]["context"]) if qas else lo
        n = max(n, floor)
        sample = None
        while True:
            s = build(rng_for(i), n, i)
            t = tokens(s)
            if t <= budget:
                sample = (s, t)
                break
            if n <= floor:
                break
            n = max(floor, n - max(1, n // 64))  # shrink a little; variance between samples is small
        if sample is None:
            skipped += 1
            continue
        (inp, prefix, outputs), t = sample
        out.append({
            "index": i,
            "input": inp,
            "gen_prefix": prefix,
            "outputs": list(outputs),
            "length": t + ttg,
            "max_length": max_seq_length,
            "task": task_name,
            "metric": task.metric,
        })
    if skipped:
        log.warning("RULER %s @ %d: skipped %d/%d samples whose gold context alone exceeds the budget",
                    task_name, max_seq_length, skipped, num_samples)
    if not out:
        raise ValueError(f"RULER {task_name}: no sample fits max_seq_length={max_seq_length}")
    return out
