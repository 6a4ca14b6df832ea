"""``hf-deltamatch card RUN_DIR --eval RESULTS.json``: a Hugging Face model card for a training run.

Reads what ``recipes/pretrain.py`` leaves in a run directory -- ``config.yaml`` (the recipe),
``summary.json`` (steps, tokens, losses), ``metrics.jsonl`` (loss curve), ``final/config.json``
(the model; ``model_config.json`` in a results folder that keeps no weights) -- plus one or more lm-eval results
files (``hf-deltamatch eval --output_path``), and writes ``README.md`` with YAML metadata (``model-index`` built
with huggingface_hub's ``EvalResult``) and ``loss_curve.png``. The card is re-read with ``ModelCard.load`` before
returning, so a card that the Hub would reject is never left behind silently.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = Path(__file__).with_name("model_card_template.md")  # package data: works from a wheel too
LM_EVAL_URL = "https://github.com/EleutherAI/lm-evaluation-harness"
RULER_URL = "https://github.com/NVIDIA/RULER"
METRIC_NAMES = {"acc": "accuracy", "acc_norm": "normalized accuracy", "perplexity": "perplexity",
                "word_perplexity": "word perplexity", "exact_match": "exact match"}


class CardError(ValueError):
    pass


# --------------------------------------------------------------------------- reading a run


@dataclasses.dataclass
class RunInfo:
    run_dir: Path
    model_dir: Path | None
    recipe: dict
    recipe_text: str
    summary: dict
    metrics: list[dict]
    model_config: dict


def read_run(run_dir: Path) -> RunInfo:
    if not run_dir.is_dir():
        raise CardError(f"run directory {run_dir} does not exist")
    model_dir = next((d for d in (run_dir / "final", run_dir) if (d / "config.json").is_file()), None)
    recipe_text, recipe = "", {}
    for name in ("config.yaml", "config.yml", "recipe.yaml"):
        p = run_dir / name
        if p.is_file():
            import yaml

            recipe_text = p.read_text()
            recipe = yaml.safe_load(recipe_text) or {}
            break
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    metrics = []
    if (run_dir / "metrics.jsonl").is_file():
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    model_config = json.loads((model_dir / "config.json").read_text()) if model_dir else {}
    if not model_config and (run_dir / "model_config.json").is_file():  # a committed run keeps no weights, only this
        model_config = json.loads((run_dir / "model_config.json").read_text())
    if not (recipe or summary or metrics or model_config):
        raise CardError(f"{run_dir} has none of config.yaml, summary.json, metrics.jsonl, final/config.json: "
                        "is it a training run directory (recipes/pretrain.py --output_dir)?")
    return RunInfo(run_dir, model_dir, recipe, recipe_text, summary, metrics, model_config)


def read_results(paths: list[Path]) -> dict:
    """Merge lm-eval results files (later files win per task) and (re)compute our summaries."""
    from .cli import add_summaries

    merged: dict[str, Any] = {"results": {}, "configs": {}, "config": {}}
    for p in paths:
        if p.is_dir():  # an --output_path folder: take the newest results_*.json under it
            found = sorted(p.rglob("results_*.json"), key=lambda f: f.stat().st_mtime)
            if not found:
                raise CardError(f"no results_*.json under {p}")
            p = found[-1]
        if not p.is_file():
            raise CardError(f"results file {p} does not exist")
        data = json.loads(p.read_text())
        if "results" not in data:
            raise CardError(f"{p} is not an lm-eval results file (no 'results' key)")
        merged["results"].update(data["results"])
        merged["configs"].update(data.get("configs", {}))
        merged["config"] = merged["config"] or data.get("config", {})
        merged.setdefault("lm_eval_version", data.get("lm_eval_version"))
        merged["groups"] = {**merged.get("groups", {}), **data.get("groups", {})}
    return add_summaries(merged)


# --------------------------------------------------------------------------- content


def loss_curve(metrics: list[dict], out: Path) -> Path | None:
    train = [r for r in metrics if r.get("kind", "train") == "train" and "loss" in r]
    evals = [r for r in metrics if r.get("kind") == "eval" and "val_loss" in r]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = "tokens" if all("tokens" in r for r in train) else "step"
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([r[x_key] for r in train], [r["loss"] for r in train], label="train loss")
    if evals and all(x_key in r for r in evals):
        ax.plot([r[x_key] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss")
    ax.set_xlabel("tokens" if x_key == "tokens" else "step")
    ax.set_ylabel("cross-entropy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _architecture(cfg: dict, summary: dict) -> list[tuple[str, Any]]:
    rows = []
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"):
        if key in cfg:
            rows.append((key, cfg[key]))
    if cfg.get("architectures"):
        rows.insert(0, ("architecture", ", ".join(cfg["architectures"])))
    if isinstance(cfg.get("layer_types"), list):
        from collections import Counter

        rows.append(("layer types", ", ".join(f"{n} x {t}" for t, n in Counter(cfg["layer_types"]).items())))
    if summary.get("params"):
        rows.append(("parameters", f"{summary['params']:,}"))
    return rows


def _attention(recipe: dict, cfg: dict, eval_attn: str | None) -> list[tuple[str, Any]]:
    attn = recipe.get("attn") or cfg.get("_attn_implementation") or eval_attn or "deltamatch_fp8"
    rows: list[tuple[str, Any]] = [("attn_implementation", attn)]
    if attn == "deltamatch_fp8":
        from hf_deltamatch.config import DeltaMatchConfig

        d = dataclasses.asdict(DeltaMatchConfig())
        d.update({k: recipe[k] for k in ("precision", "delta") if k in recipe})
        rows += [(k, v) for k, v in d.items()]
    if "fp8_linear" in recipe:
        rows.append(("fp8 linear layers (torchao)", recipe["fp8_linear"]))
    if "mixed_precision" in recipe:
        rows.append(("mixed precision", recipe["mixed_precision"]))
    return rows


def _training(recipe: dict, summary: dict) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    if "tokens" in summary:
        rows.append(("tokens seen", f"{summary['tokens']:,}"))
    if "steps" in summary:
        rows.append(("optimizer steps", summary["steps"]))
    for key, label in (("data", "data"), ("seq_len", "sequence length"), ("batch_size", "batch size / device"),
                       ("grad_accum", "gradient accumulation"), ("optimizer", "optimizer"), ("lr", "peak LR"),
                       ("warmup_steps", "warmup steps"), ("max_steps", "max steps"), ("seed", "seed")):
        if key in recipe:
            rows.append((label, recipe[key]))
    for key, label in (("first_train_loss", "first train loss"), ("final_train_loss", "final train loss"),
                       ("final_val_loss", "final validation loss"), ("tokens_per_s", "throughput (tokens/s)"),
                       ("elapsed_s", "wall time (s)")):
        if isinstance(summary.get(key), (int, float)):
            rows.append((label, round(summary[key], 4)))
    return rows


def _md_table(head: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _lm_eval_rows(results: dict) -> list[tuple[str, str, float]]:
    """(task, metric, value) for every plain lm-eval metric (not RULER, not stderr, not groups)."""
    from .ruler.constants import LM_EVAL_PREFIX

    out = []
    for task, entry in sorted(results.get("results", {}).items()):
        if task.startswith(LM_EVAL_PREFIX) or task in results.get("groups", {}):
            continue
        for key, val in entry.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(val, (int, float)) or isinstance(val, bool):
                continue
            out.append((task, metric if filt == "none" else f"{metric} ({filt})", float(val)))
    return out


def eval_results(results: dict, source_url: str | None = None) -> list:
    from huggingface_hub import EvalResult

    out = []
    configs = results.get("configs", {})
    # model-index groups results by (dataset type, config, split), not by name: keep one task per group.
    owner: dict[tuple, str] = {}
    for task, metric, value in _lm_eval_rows(results):
        cfg = configs.get(task, {})
        dtype = cfg.get("dataset_path") or task
        key = (dtype, cfg.get("dataset_name"), cfg.get("test_split") or cfg.get("validation_split"))
        if owner.setdefault(key, task) != task:
            dtype = task
        out.append(EvalResult(
            task_type="text-generation", dataset_type=dtype, dataset_name=task,
            dataset_config=cfg.get("dataset_name") or None,
            dataset_split=cfg.get("test_split") or cfg.get("validation_split") or None,
            metric_type=metric.split(" ")[0], metric_name=METRIC_NAMES.get(metric, metric),
            metric_value=round(value, 4), source_name="lm-evaluation-harness", source_url=source_url or LM_EVAL_URL))
    dm = results.get("deltamatch", {})
    if "commonsense" in dm:
        cs = dm["commonsense"]
        out.append(EvalResult(
            task_type="text-generation", dataset_type="commonsense_dm",
            dataset_name=f"Commonsense average ({cs['num_tasks']}/9 tasks)", metric_type="average",
            metric_name="average of " + ", ".join(f"{t} {s['metric']}" for t, s in cs["tasks"].items()) + " (%)",
            metric_value=cs["average"], source_name="hf-deltamatch eval", source_url=source_url or LM_EVAL_URL))
    if "ruler" in dm:
        from .ruler.constants import TASKS

        ru = dm["ruler"]
        for task, row in ru["tasks"].items():
            for length, value in row.items():
                out.append(EvalResult(
                    task_type="text-generation", dataset_type=f"ruler/{task}", dataset_name=f"RULER {task}",
                    dataset_config=length, metric_type=f"string_match_{TASKS[task].metric}",
                    metric_name=f"string match ({TASKS[task].metric}, %) at {length} tokens", metric_value=value,
                    source_name="hf-deltamatch RULER (offline)", source_url=source_url or RULER_URL))
        for length, value in ru["average"].items():
            out.append(EvalResult(
                task_type="text-generation", dataset_type="ruler/average",
                dataset_name=f"RULER average ({ru['num_tasks']}/13 tasks)", dataset_config=length,
                metric_type="average", metric_name=f"average string match (%) at {length} tokens",
                metric_value=value, source_name="hf-deltamatch RULER (offline)", source_url=source_url or RULER_URL))
    return out


def _ruler_md(ru: dict) -> str:
    from .ruler.lm_eval_tasks import _fmt_len

    lengths = [str(L) for L in ru["lengths"]]
    rows = [[t] + [f"{r[L]:.2f}" if L in r else "-" for L in lengths] for t, r in ru["tasks"].items()]
    rows.append([f"**average** ({ru['num_tasks']}/13)"] + [f"**{ru['average'][L]:.2f}**" for L in lengths])
    return _md_table(["task"] + [_fmt_len(int(L)) for L in lengths], rows)


def _commonsense_md(cs: dict) -> str:
    rows = [[t, s["metric"], f"{s['value']:.2f}"] for t, s in cs["tasks"].items()]
    label = "**average**" + ("" if cs["complete"] else f" (incomplete: {cs['num_tasks']}/9)")
    rows.append([label, "", f"**{cs['average']:.2f}**"])
    return _md_table(["task", "metric", "%"], rows)


# --------------------------------------------------------------------------- writing


def write_card(run_dir: Path, eval_paths: list[Path], output_dir: Path | None = None, model_name: str | None = None,
               repo_id: str | None = None, license: str = "apache-2.0", template: Path | None = None,
               base_model: str | None = None, datasets: list[str] | None = None) -> Path:
    from huggingface_hub import ModelCard, ModelCardData

    run = read_run(run_dir)
    results = read_results(eval_paths) if eval_paths else {"results": {}}
    output_dir = output_dir or run.model_dir or run_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    name = model_name or run.summary.get("name") or run.recipe.get("run_name") or run_dir.resolve().name
    template = template or DEFAULT_TEMPLATE
    if not template.is_file():
        raise CardError(f"model card template {template} not found; pass --template PATH (a Jinja model card template)")

    curve = loss_curve(run.metrics, output_dir / "loss_curve.png")
    evals = eval_results(results)
    model_arg = run.recipe.get("model")
    card_data = ModelCardData(
        model_name=name, license=license, library_name="transformers", pipeline_tag="text-generation",
        tags=["hf-deltamatch", "deltamatch_fp8", "fp8", "fp8-attention"],
        base_model=base_model or (model_arg if isinstance(model_arg, str) and not Path(model_arg).exists()
                                  else None),
        datasets=datasets, eval_results=evals or None,
    )
    dm = results.get("deltamatch", {})
    margs = results.get("config", {}).get("model_args")
    eval_attn = dm.get("attn_implementation") or (margs.get("attn_implementation") if isinstance(margs, dict)
                                                  else None)
    lm_rows = _lm_eval_rows(results)
    card = ModelCard.from_template(
        card_data, template_path=str(template),
        model_name=name, repo_id=repo_id or name,
        architecture=_architecture(run.model_config, run.summary),
        attention=_attention(run.recipe, run.model_config, eval_attn),
        train_attn=run.recipe.get("attn") or run.summary.get("attn") or "deltamatch_fp8",
        train_precision=run.recipe.get("precision") or run.summary.get("precision") or "fp8",
        train_delta=run.recipe.get("delta") or run.summary.get("delta") or "matching",
        training=_training(run.recipe, run.summary),
        loss_curve=curve.name if curve else None,
        recipe=run.recipe_text.strip(),
        ruler_table=_ruler_md(dm["ruler"]) if "ruler" in dm else "",
        commonsense_table=_commonsense_md(dm["commonsense"]) if "commonsense" in dm else "",
        lm_eval_table=_md_table(["task", "metric", "value"], [[t, m, f"{v:.4f}"] for t, m, v in lm_rows])
        if lm_rows else "",
        lm_eval_version=results.get("lm_eval_version") or _version("lm_eval"),
        eval_attn=eval_attn or "deltamatch_fp8",
    )
    path = output_dir / "README.md"
    card.save(path)
    parsed = ModelCard.load(path)  # what the Hub will read; fails loudly on bad metadata
    def ident(e):
        return (e.dataset_name, e.dataset_config, e.metric_type, e.metric_value)

    if sorted(map(ident, parsed.data.eval_results or []), key=str) != sorted(map(ident, evals), key=str):
        raise CardError(f"{path}: the model-index read back differs from the results written")
    return path


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "?"


def card_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hf-deltamatch card", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="training run directory (recipes/pretrain.py --output_dir)")
    p.add_argument("--eval", dest="eval_paths", type=Path, action="append", default=[],
                   help="lm-eval results JSON or --output_path folder (repeatable)")
    p.add_argument("--output", type=Path, default=None, help="where README.md goes (default: RUN_DIR/final)")
    p.add_argument("--name", default=None, help="model name (default: the run name)")
    p.add_argument("--repo-id", default=None, help="Hub repo id used in the usage snippet")
    p.add_argument("--license", default="apache-2.0")
    p.add_argument("--base-model", default=None)
    p.add_argument("--dataset", dest="datasets", action="append", default=None, help="training dataset id")
    p.add_argument("--template", type=Path, default=None, help=f"Jinja template (default {DEFAULT_TEMPLATE})")
    a = p.parse_args(argv)
    try:
        path = write_card(a.run_dir, a.eval_paths, a.output, a.name, a.repo_id, a.license, a.template,
                          a.base_model, a.datasets)
    except (CardError, json.JSONDecodeError) as e:
        print(f"hf-deltamatch card: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0
