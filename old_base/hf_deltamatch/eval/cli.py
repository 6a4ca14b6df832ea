"""``hf-deltamatch eval`` (lm-eval's CLI with deltamatch_fp8) and ``hf-deltamatch card``.

``eval`` takes exactly lm-eval's arguments (``run``, ``ls``, ``validate``; ``run`` is implied as in
``lm_eval``) and adds, before handing over to lm-eval:

* the ``hf-deltamatch`` model (default ``--model``), which registers and uses deltamatch_fp8;
* this package's tasks on the include path: ``ruler_dm`` (13 offline RULER tasks) and
  ``commonsense_dm`` (nine-task commonsense preset);
* offline mode (``HF_HUB_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``) unless already set;
* a preflight that drops RULER tasks whose local files are missing and commonsense tasks whose
  datasets are not cached, saying what is missing (a task named explicitly still fails loudly);
* a ``deltamatch`` section in lm-eval's results JSON: the RULER task x length table with its
  average, and the commonsense average, printed after lm-eval's own tables.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from . import TASKS_DIR

log = logging.getLogger("hf_deltamatch.eval")


def _say(msg: str) -> None:
    print(f"hf-deltamatch eval: {msg}", file=sys.stderr, flush=True)


def _expand_and_filter(tasks: list[str], meta: dict, task_manager) -> list[str]:
    """Expand our groups into subtasks and drop those that cannot run offline."""
    from . import commonsense
    from .ruler import constants as RC
    from .ruler.sources import missing_sources

    out: list[str] = []
    ruler_group = RC.LM_EVAL_GROUP in tasks
    cs_group = commonsense.GROUP in tasks
    for t in tasks:
        if t == RC.LM_EVAL_GROUP:
            skipped = {}
            for name in RC.TASK_NAMES:
                miss = missing_sources(RC.TASKS[name].needs, meta)
                if miss:
                    skipped[name] = miss
                else:
                    out.append(RC.LM_EVAL_PREFIX + name)
            for source_msgs in {m for msgs in skipped.values() for m in msgs}:
                names = [n for n, msgs in skipped.items() if source_msgs in msgs]
                _say(f"skipping RULER {', '.join(names)}: {source_msgs}")
        elif t == commonsense.GROUP:
            missing = commonsense.missing_datasets(commonsense.TASKS, task_manager)
            if missing:
                _say(commonsense.missing_message(missing))
            out += [c for c in commonsense.TASKS if c not in missing]
        else:
            name = t.removeprefix(RC.LM_EVAL_PREFIX)
            if t.startswith(RC.LM_EVAL_PREFIX) and name in RC.TASKS:
                miss = missing_sources(RC.TASKS[name].needs, meta)
                if miss:  # asked for by name: fail now, before any model is loaded
                    raise SystemExit(f"hf-deltamatch eval: cannot run {t}: " + " ".join(miss))
            out.append(t)
    if (ruler_group or cs_group) and not out:
        raise SystemExit("hf-deltamatch eval: nothing left to run after the preflight above.")
    return list(dict.fromkeys(out))


def add_summaries(results: dict) -> dict:
    """Attach the RULER and commonsense summaries to an lm-eval results dict (in place)."""
    from . import commonsense
    from .ruler import lm_eval_tasks

    summary: dict[str, Any] = {}
    ruler = lm_eval_tasks.summarize(results)
    if ruler:
        summary["ruler"] = ruler
    cs = commonsense.summarize(results)
    if cs:
        summary["commonsense"] = cs
    attn = (results.get("config", {}).get("model_args") or {})
    if isinstance(attn, dict):
        summary["attn_implementation"] = attn.get("attn_implementation", "deltamatch_fp8"
                                                  if results.get("config", {}).get("model") == "hf-deltamatch"
                                                  else None)
    if summary:
        results["deltamatch"] = summary
    return results


def format_summaries(results: dict) -> str:
    from . import commonsense
    from .ruler import lm_eval_tasks

    parts = []
    s = results.get("deltamatch", {})
    if "ruler" in s:
        parts.append(lm_eval_tasks.format_summary(s["ruler"]))
    if "commonsense" in s:
        parts.append(commonsense.format_summary(s["commonsense"]))
    return "\n\n".join(parts)


def _as_dict(value: Any) -> dict:
    if not value:
        return {}
    if isinstance(value, dict):
        return dict(value)
    from lm_eval.utils import simple_parse_args_string

    return simple_parse_args_string(str(value))


def _file_config(args: argparse.Namespace) -> dict:
    if not getattr(args, "config", None):
        return {}
    from lm_eval.config.evaluate_config import EvaluatorConfig

    return EvaluatorConfig.load_yaml_config(args.config)


def eval_main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import lm_eval
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    from . import lm_eval_model  # noqa: F401 - registers the hf-deltamatch model

    setup_logging()
    cli = HarnessCLI()
    commands = set(cli._subparsers.choices)
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        cli._parser.print_help()
        print("\nhf-deltamatch adds: --model hf-deltamatch (default), tasks ruler_dm / ruler_dm_<task> and "
              "commonsense_dm (see eval/README.md).")
        return 0
    if argv[0] not in commands:
        argv.insert(0, "run")  # as lm_eval: bare arguments mean `run`
    args = cli._parser.parse_args(argv)

    if hasattr(args, "include_path"):
        extra = [p for p in str(args.include_path or "").split(":") if p]
        args.include_path = [str(TASKS_DIR), *extra]

    if args.command != "run":
        args.func(args)
        return 0

    # A --config YAML may carry model/tasks/metadata; CLI flags win over it, as in lm-eval.
    file_cfg = _file_config(args)
    args.model = args.model or file_cfg.get("model") or lm_eval_model.MODEL_NAME
    if file_cfg.get("include_path"):
        args.include_path += [p for p in str(file_cfg["include_path"]).split(":") if p]
    tasks = args.tasks or file_cfg.get("tasks")
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t]
    if not tasks:
        _say("--tasks is required (e.g. --tasks ruler_dm, --tasks commonsense_dm, --tasks hellaswag)")
        return 2
    from lm_eval.tasks import TaskManager

    # lm-eval replaces the file's dicts with the flag's; merge instead so a config file can hold
    # dtype/max_length/lengths while the command line adds pretrained= and local paths.
    for key in ("model_args", "metadata"):
        if file_cfg.get(key):
            setattr(args, key, {**_as_dict(file_cfg[key]), **(getattr(args, key, None) or {})})
    meta = {**(args.model_args or {}), **(args.metadata or {})}
    args.tasks = _expand_and_filter(list(tasks), meta, TaskManager(include_path=args.include_path))
    if any(t.startswith("ruler_dm_") for t in args.tasks) and "max_length" not in meta:
        # HFLM would otherwise cut prompts to the model's default length (left truncation drops the
        # start of the haystack); RULER prompts are sized to fit the longest requested length.
        from .ruler.lm_eval_tasks import parse_lengths

        args.model_args = {**(args.model_args or {}), "max_length": max(parse_lengths(meta.get("max_seq_lengths")))}

    captured: dict[str, Any] = {}
    original = lm_eval.simple_evaluate if "simple_evaluate" in vars(lm_eval) else None
    from lm_eval.evaluator import simple_evaluate as _simple_evaluate

    def simple_evaluate(*a, **kw):
        res = _simple_evaluate(*a, **kw)
        if res is not None:
            add_summaries(res)  # before lm-eval writes the JSON, so the summary lands in it
            captured["results"] = res
        return res

    lm_eval.simple_evaluate = simple_evaluate
    from .ruler.sources import MissingSourceError

    try:
        args.func(args)
    except MissingSourceError as e:
        _say(str(e))
        return 2
    finally:
        if original is None:
            del lm_eval.simple_evaluate
        else:
            lm_eval.simple_evaluate = original
    text = format_summaries(captured.get("results") or {})
    if text:
        print("\n" + text)
    return 0


def card_main(argv: list[str]) -> int:
    from .model_card import card_main as _card_main

    return _card_main(argv)


def main() -> None:  # python -m hf_deltamatch.eval.cli eval|card ...
    parser = argparse.ArgumentParser(prog="python -m hf_deltamatch.eval.cli")
    parser.add_argument("command", choices=("eval", "card"))
    ns, rest = parser.parse_known_args()
    sys.exit((eval_main if ns.command == "eval" else card_main)(rest))


if __name__ == "__main__":
    main()
