"""RULER generation: exact token budgets, needles/answers really in the context, seeds, offline sources."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from _eval_fixtures import ruler_sources, tiny_model_dir, tiny_tokenizer  # noqa: F401
from hf_deltamatch.eval.ruler import TASK_NAMES, TASKS, MissingSourceError, generate_samples, prompt_text
from hf_deltamatch.eval.ruler.lm_eval_tasks import build_records, parse_lengths

N = 3
LENGTHS = (1024, 4096)


@pytest.fixture(scope="module")
def generated(tiny_tokenizer, ruler_sources):
    return {(t, L): generate_samples(t, tiny_tokenizer, L, num_samples=N, seed=11, metadata=ruler_sources,
                                     progress=False)
            for t in TASK_NAMES for L in LENGTHS}


def test_all_thirteen_tasks_defined():
    assert TASK_NAMES == ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                          "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2"]
    assert {t: TASKS[t].tokens_to_generate for t in ("niah_single_1", "vt", "cwe", "fwe", "qa_1")} == \
        {"niah_single_1": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32}
    assert [t for t in TASK_NAMES if TASKS[t].metric == "part"] == ["qa_1", "qa_2"]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("task", TASK_NAMES)
def test_exact_token_budget(generated, tiny_tokenizer, task, length):
    rows = generated[(task, length)]
    assert len(rows) == N
    ttg = TASKS[task].tokens_to_generate
    for r in rows:
        n_prompt = len(tiny_tokenizer(prompt_text(r["input"], r["gen_prefix"]))["input_ids"])
        assert r["length"] == n_prompt + ttg  # recorded length is the real prompt size + generation room
        assert r["length"] <= length  # never over budget
        assert r["length"] >= 0.8 * length, f"{task}@{length}: only {r['length']} tokens used"
        assert r["max_length"] == length and r["task"] == task and r["outputs"]


@pytest.mark.parametrize("task", [t for t in TASK_NAMES if t.startswith("niah")])
def test_niah_needles_in_context(generated, task):
    a = TASKS[task].args
    for L in LENGTHS:
        for r in generated[(task, L)]:
            # every answer is a value of a needle sentence in the context
            for value in r["outputs"]:
                assert re.search(rf"One of the special magic {a['type_needle_v']} for .+? is: {re.escape(value)}\.",
                                 r["input"]), value
            n_answers = a["num_needle_v"] * a["num_needle_q"]
            assert len(r["outputs"]) == n_answers
            # the queried key(s) are named in the answer prefix, and each one's needle is in the context
            keys = re.findall(r"for (.+) mentioned", r["gen_prefix"])[0].replace(", and ", ", ").split(", ")
            assert len(keys) == a["num_needle_q"]
            for k in keys:
                assert f"for {k} is: " in r["input"]
            single = n_answers == 1
            assert r["gen_prefix"].endswith("mentioned in the provided text is" if single else
                                            "mentioned in the provided text are")
            assert r["input"].startswith("A special magic" if single else "Some special magic")


def test_vt_chain_in_context(generated):
    for L in LENGTHS:
        for r in generated[("vt", L)]:
            value = re.search(r"assgined the value (\d+)", r["gen_prefix"]).group(1)
            names = r["outputs"]
            assert len(names) == 5
            assert f"VAR {names[0]} = {value}" in r["input"]
            for prev, nxt in zip(names, names[1:]):
                assert f"VAR {nxt} = VAR {prev}" in r["input"]
            assert r["input"].count("Memorize and track") == 2  # solved example + the question


def _main_list(text: str, head: str) -> str:
    start = text.rindex(head) + len(head)
    return text[start:text.rindex("\nQuestion:")]


def test_cwe_answers_are_the_most_common_words(generated):
    for L in LENGTHS:
        for r in generated[("cwe", L)]:
            items = re.findall(r"\d+\. (\S+)", _main_list(r["input"], "Memorize the ones that appear most often.\n"))
            counts = Counter(items)
            assert len(r["outputs"]) == 10
            top = {w for w, _ in counts.most_common(10)}
            assert top == set(r["outputs"])
            assert min(counts[w] for w in r["outputs"]) > max(c for w, c in counts.items() if w not in top)


def test_fwe_answers_are_the_most_frequent_coded_words(generated):
    for L in LENGTHS:
        for r in generated[("fwe", L)]:
            words = _main_list(r["input"], "Find the three most frequently appeared coded words. ").split()
            counts = Counter(w for w in words if w != "...")
            ranked = [w for w, _ in counts.most_common()]
            assert r["outputs"] == ranked[:3]
            c = [counts[w] for w in ranked[:4]]
            assert c[0] > c[1] > c[2] > c[3]


@pytest.mark.parametrize("task", ["qa_1", "qa_2"])
def test_qa_gold_document_in_context(generated, task):
    for L in LENGTHS:
        for r in generated[(task, L)]:
            assert any(ref in r["input"] for ref in r["outputs"])
            assert r["gen_prefix"] == "Answer:"
            assert r["input"].count("Document ") >= 3


def test_qa_squad_keeps_all_references(generated):
    r = generated[("qa_1", 1024)][0]
    assert len(r["outputs"]) == 2 and r["outputs"][1] == f"the town {r['outputs'][0]}"


@pytest.mark.parametrize("task", ["niah_single_2", "niah_multikey_2", "vt", "cwe", "fwe", "qa_1", "qa_2"])
def test_seeded_and_reproducible(tiny_tokenizer, ruler_sources, generated, task):
    again = generate_samples(task, tiny_tokenizer, 1024, num_samples=N, seed=11, metadata=ruler_sources,
                             progress=False)
    assert again == generated[(task, 1024)]
    other = generate_samples(task, tiny_tokenizer, 1024, num_samples=N, seed=12, metadata=ruler_sources,
                             progress=False)
    assert [r["input"] for r in other] != [r["input"] for r in again]
    assert len({r["input"] for r in again}) == N  # samples differ from each other


def test_missing_sources_are_named_not_downloaded(tiny_tokenizer, monkeypatch, tmp_path):
    for env in ("HF_DELTAMATCH_RULER_ESSAYS", "HF_DELTAMATCH_RULER_SQUAD", "HF_DELTAMATCH_RULER_HOTPOTQA"):
        monkeypatch.delenv(env, raising=False)
    with pytest.raises(MissingSourceError, match="essay_path.*HF_DELTAMATCH_RULER_ESSAYS"):
        generate_samples("niah_single_2", tiny_tokenizer, 1024, num_samples=1, metadata={})
    with pytest.raises(MissingSourceError, match="does not exist"):
        generate_samples("qa_1", tiny_tokenizer, 1024, num_samples=1, metadata={"squad_path": str(tmp_path / "no")})
    with pytest.raises(MissingSourceError, match="hotpotqa_path"):
        generate_samples("qa_2", tiny_tokenizer, 1024, num_samples=1)
    # tasks with built-in haystacks need nothing
    assert generate_samples("niah_multikey_2", tiny_tokenizer, 1024, num_samples=1, progress=False)


def test_sources_from_environment(tiny_tokenizer, ruler_sources, monkeypatch):
    monkeypatch.setenv("HF_DELTAMATCH_RULER_ESSAYS", ruler_sources["essay_path"])
    rows = generate_samples("niah_single_3", tiny_tokenizer, 1024, num_samples=1, progress=False)
    assert rows[0]["outputs"][0] in rows[0]["input"]


def test_essay_directory_and_text_formats(tiny_tokenizer, ruler_sources, tmp_path):
    import json

    text = json.loads(open(ruler_sources["essay_path"]).read())["text"]
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text(text)
    (tmp_path / "e.txt").write_text(text)
    (tmp_path / "e.jsonl").write_text(json.dumps({"text": text}) + "\n")
    rows = [generate_samples("niah_single_2", tiny_tokenizer, 1024, num_samples=1, seed=3, progress=False,
                             metadata={"essay_path": str(p)})
            for p in (tmp_path / "dir", tmp_path / "e.txt", tmp_path / "e.jsonl", ruler_sources["essay_path"])]
    assert all(r == rows[0] for r in rows)  # same words, same samples, whatever the container


def test_too_short_length_is_a_clear_error(tiny_tokenizer):
    with pytest.raises(ValueError, match="no room"):
        generate_samples("niah_single_1", tiny_tokenizer, 160, num_samples=1, progress=False)


def test_lm_eval_dataset_builder(tiny_model_dir, ruler_sources):
    rows = build_records("niah_single_2", {"pretrained": str(tiny_model_dir), "max_seq_lengths": [1024, 2048],
                                           "num_samples": 2, **ruler_sources}, progress=False)
    assert [r["max_length"] for r in rows] == [1024, 1024, 2048, 2048]
    with pytest.raises(ValueError, match="pretrained"):
        build_records("niah_single_1", {"max_seq_lengths": [1024]})


def test_parse_lengths():
    assert parse_lengths(None) == [4096]
    assert parse_lengths([4096, 8192]) == [4096, 8192]
    assert parse_lengths("4096,8192") == [4096, 8192]
    assert parse_lengths("[1024, 2048]") == [1024, 2048]
    assert parse_lengths("4K,128K") == [4096, 131072]
    assert parse_lengths(8192) == [8192]


def test_sentence_split_keeps_text_and_quotes():
    from hf_deltamatch.eval.ruler.sources import split_sentences

    text = 'He said "stop." Then he left. Is it 3 p.m. now? Yes! In 1999 (or so.) It rained. e.g. this'
    parts = split_sentences(text)
    assert parts == ['He said "stop."', "Then he left.", "Is it 3 p.m. now?", "Yes!", "In 1999 (or so.)",
                     "It rained. e.g. this"]
    assert " ".join(parts) == text
