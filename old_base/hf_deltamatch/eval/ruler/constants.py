"""RULER task definitions, following NVIDIA/RULER (scripts/synthetic.yaml and
scripts/data/synthetic/constants.py): templates, answer prefixes, tokens to generate,
needle/haystack types and the metric each task is scored with.

The answer prefix is kept apart from the template: lm-eval feeds it as ``gen_prefix``
(appended after a single space), which reproduces RULER's ``template + answer_prefix``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NUM_SAMPLES = 500  # RULER's default per task and length
RANDOM_SEED = 42

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n"
    "{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = "The special magic {type_needle_v} for {query} mentioned in the provided text are"

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
# "assgined" is RULER's own spelling; kept so prompts match the published benchmark.
VT_ANSWER_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assgined the value {query}, they are:"
)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = "Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words.\n\nThe following are given documents.\n\n{context}\n\n"
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = "Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"


@dataclass(frozen=True)
class RulerTask:
    name: str
    kind: str  # niah | vt | cwe | fwe | qa
    tokens_to_generate: int
    metric: str  # "all" (string_match_all) or "part" (string_match_part)
    args: dict = field(default_factory=dict)
    # Local sources the task reads ("essay", "squad", "hotpotqa"); never downloaded.
    needs: tuple[str, ...] = ()


def _niah(name: str, haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> RulerTask:
    return RulerTask(
        name=name,
        kind="niah",
        tokens_to_generate=128,
        metric="all",
        args=dict(type_haystack=haystack, type_needle_k=k, type_needle_v=v,
                  num_needle_k=nk, num_needle_v=nv, num_needle_q=nq),
        needs=("essay",) if haystack == "essay" else (),
    )


TASKS: dict[str, RulerTask] = {
    t.name: t
    for t in [
        _niah("niah_single_1", "noise", "words", "numbers"),
        _niah("niah_single_2", "essay", "words", "numbers"),
        _niah("niah_single_3", "essay", "words", "uuids"),
        _niah("niah_multikey_1", "essay", "words", "numbers", nk=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "essay", "words", "numbers", nv=4),
        _niah("niah_multiquery", "essay", "words", "numbers", nq=4),
        RulerTask("vt", "vt", 30, "all", dict(num_chains=1, num_hops=4)),
        RulerTask("cwe", "cwe", 120, "all", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
        RulerTask("fwe", "fwe", 50, "all", dict(alpha=2.0, coded_wordlen=6)),
        RulerTask("qa_1", "qa", 32, "part", dict(dataset="squad"), needs=("squad",)),
        RulerTask("qa_2", "qa", 32, "part", dict(dataset="hotpotqa"), needs=("hotpotqa",)),
    ]
}

TASK_NAMES = list(TASKS)
# lm-eval task names (prefixed so they never collide with lm-eval's own `ruler` tasks).
LM_EVAL_PREFIX = "ruler_dm_"
LM_EVAL_GROUP = "ruler_dm"
