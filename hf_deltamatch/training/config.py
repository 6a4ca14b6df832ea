"""TrainConfig: every knob of the training recipes, loadable from YAML/JSON and overridable on the CLI.

The dataclass defaults ARE the `tiny-cpu` recipe (recipes/configs/tiny-cpu.yaml repeats them and a test keeps
the two equal), so `accelerate launch recipes/pretrain.py` with no arguments trains something real offline.
`validate()` runs before any model is built or data is read, so a typo fails in a second, not after tokenizing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

ATTN_CHOICES = ("deltamatch_fp8", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def _registered_attention(name: str) -> bool:
    """Whether `name` is an attention function registered with transformers (e.g. a benchmark's baseline)."""
    from transformers import AttentionInterface

    return name in AttentionInterface._global_mapping


class ConfigError(ValueError):
    """A bad recipe configuration (raised before any compute)."""


# Tiny hybrid: Qwen3.5 text model (dense MLP), 3 Gated DeltaNet layers : 1 GQA attention layer, head_dim 32.
TINY_CPU_MODEL = {
    "model_type": "qwen3_5_text",
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


@dataclasses.dataclass
class TrainConfig:
    # --- model ---------------------------------------------------------------------------------------
    model: str | None = None  # local checkpoint dir (continued pretraining); None = from scratch
    model_config: Any = dataclasses.field(default_factory=lambda: dict(TINY_CPU_MODEL))  # dict or YAML/JSON path
    attn: str = "deltamatch_fp8"
    precision: str = "fp8"  # deltamatch_fp8 only: fp8 | bf16 | fp8_fwd | fp8_bwd (ablations: modeling.SPLIT_PRECISION)
    delta: str = "matching"  # deltamatch_fp8 only: matching | stale
    fp8_linear: bool = False  # torchao float8 training for nn.Linear (FP8 tensor cores on H100/H200; CPU emulates)
    compile_fp8_linear: bool = False  # torch.compile each float8 linear (torchao fuses its casts only when compiled)
    gradient_checkpointing: bool = False
    fused_norms: bool = False  # the RMSNorms through F.rms_norm (one op, fused on CUDA) instead of eager fp32 ops
    loss_chunk: int = 0  # >0: cross-entropy over chunks of this many tokens, logits recomputed in backward
    rope_theta: float | None = None  # override (context extension)
    rope_scaling: Any = None  # dict merged into config.rope_parameters, e.g. {"rope_type": "yarn", "factor": 8}
    max_position_embeddings: int | None = None
    lora: str | None = None  # "r,alpha,target1,target2,..." e.g. "8,16,q_proj,v_proj"
    # --- data ----------------------------------------------------------------------------------------
    data: Any = "stdlib"  # "stdlib" (offline corpus from Python's own sources/docs), a generated task
    # ("bigram_backcopy": training/tasks.py), paths/globs, or hub name
    task: Any = None  # parameters of the generated task named by `data` (a mapping; None: its defaults)
    data_format: str = "auto"  # auto | text | json | parquet | hub
    text_field: str = "text"
    streaming: bool = False
    val_fraction: float = 0.02  # held-out documents (map-style)
    data_seed: int = 0  # which documents are held out (a generated task: its chain and sequences): fixed apart from
    # --seed, so every seed sees one split
    val_docs: int = 200  # held-out documents (streaming: the first val_docs of the stream)
    corpus_bytes: int = 6_000_000  # size cap of the "stdlib" corpus
    tokenizer: str = "train"  # "train" (BPE trained locally on the training split) or a local tokenizer dir
    vocab_size: int = 4096  # for tokenizer="train"
    seq_len: int = 256
    shuffle_buffer: int = 10_000  # streaming shuffle buffer (packed sequences)
    num_proc: int | None = None  # datasets.map workers
    # --- optimization --------------------------------------------------------------------------------
    optimizer: str = "adamw"  # adamw | muon (torch.optim.Muon on 2-D hidden weights, AdamW on the rest)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    adam_betas: Any = (0.9, 0.95)
    muon_momentum: float = 0.95
    clip_grad: float = 1.0
    batch_size: int = 8  # packed sequences per device per micro-batch
    grad_accum: int = 1
    max_steps: int = 240
    max_minutes: float = 0.0  # >0: stop (final eval + checkpoint + save) after this much training time
    mixed_precision: str = "bf16"  # bf16 autocast | no
    seed: int = 0  # initialization, data order (not the validation split: --data_seed)
    # --- bookkeeping ---------------------------------------------------------------------------------
    output_dir: str = "runs/tiny-cpu"
    run_name: str | None = None
    log_every: int = 5
    eval_every: int = 60
    eval_batches: int = 8
    save_every: int = 120
    keep_checkpoints: int = 2
    resume: str | None = None  # "auto" (latest checkpoint in output_dir) or a checkpoint dir
    attn_stats: int = 0  # >0: every this many steps, per attention layer stats of one head (training/attn_stats.py)
    save_final: bool = True
    num_workers: int = 0
    # CPU only: torch intra-op threads. Small models run thousands of tiny ops; with 2+ threads every op pays an
    # OpenMP barrier, and on a shared machine a descheduled thread stalls each one (measured 100x slower).
    # 0 = torch's default.
    cpu_threads: int = 1

    # ------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["adam_betas"] = list(self.adam_betas)
        return d

    @property
    def name(self) -> str:
        return self.run_name or Path(self.output_dir).name


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_BOOL = {n for n, f in FIELDS.items() if f.type in ("bool",)}
_INT = {n for n, f in FIELDS.items() if f.type in ("int", "int | None")}
_FLOAT = {n for n, f in FIELDS.items() if f.type in ("float", "float | None")}
_JSONISH = {"model_config", "rope_scaling", "adam_betas", "data", "task"}


def load_config_file(path: str | os.PathLike) -> dict:
    """Read a YAML or JSON mapping (recipe config or model config)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (looked relative to {os.getcwd()}).")
    text = p.read_text()
    if p.suffix == ".json":
        out = json.loads(text)
    else:
        import yaml

        out = yaml.safe_load(text)
    if not isinstance(out, dict):
        raise ConfigError(f"{p} must hold a mapping of settings, got {type(out).__name__}.")
    return out


def _check_keys(d: dict, source: str) -> None:
    unknown = sorted(set(d) - set(FIELDS) - {"config"})
    if unknown:
        raise ConfigError(
            f"{source}: unknown setting(s) {unknown}. Valid settings: {sorted(FIELDS)}."
        )


def _parse_jsonish(name: str, value: str):
    s = value.strip()
    if name == "data" and not s.startswith(("[", "{")):
        return s.split(",") if "," in s else s
    if name == "model_config" and not s.startswith("{"):
        return s  # a path
    if name == "task" and s.lower() in ("none", "null"):
        return None
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--{name}: expected JSON (e.g. '{{\"rope_type\": \"yarn\", \"factor\": 8}}'), "
                          f"got {value!r}: {e}")


def build_parser(description: str = "hf_deltamatch training recipe") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="recipe YAML/JSON (e.g. recipes/configs/hybrid-small.yaml); CLI flags override it")
    p.add_argument("--seeds", help="run once per seed into OUTPUT_DIR/seed-N and summarize the spread, e.g. 0,1,2 "
                                   "(hf_deltamatch/training/sweep.py); --seed is then ignored")
    defaults = TrainConfig()
    for name, f in FIELDS.items():
        default = getattr(defaults, name)
        if name in _BOOL:
            p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None,
                           help=f"(default {default})")
        elif name in _JSONISH:
            p.add_argument(f"--{name}", type=str, default=None,
                           help="JSON or path" if name == "model_config" else "JSON")
        else:
            typ = int if name in _INT else float if name in _FLOAT else str
            p.add_argument(f"--{name}", type=typ, default=None, help=f"(default {default!r})")
    return p


def parse_config(argv: list[str] | None = None, base: dict | None = None,
                 description: str | None = None) -> TrainConfig:
    """TrainConfig from (dataclass defaults) <- base (a stage's defaults) <- --config file <- CLI flags."""
    parser = build_parser(description or "hf_deltamatch training recipe")
    args = parser.parse_args(argv)
    merged: dict = {}
    if base:
        _check_keys(base, "stage defaults")
        merged.update(base)
    if args.config:
        file_cfg = load_config_file(args.config)
        _check_keys(file_cfg, args.config)
        merged.update(file_cfg)
    for name in FIELDS:
        v = getattr(args, name)
        if v is None:
            continue
        merged[name] = _parse_jsonish(name, v) if name in _JSONISH else v
    # "none"/"null" on the CLI clears optional settings (e.g. --resume none)
    for k, v in list(merged.items()):
        if isinstance(v, str) and v.lower() in ("none", "null") and k in ("model", "resume", "lora", "rope_scaling"):
            merged[k] = None
    if merged.get("model") and "model_config" not in (base or {}) and "model_config" not in merged:
        merged["model_config"] = None  # a checkpoint brings its own config
    cfg = TrainConfig(**merged)
    validate(cfg)
    return cfg


def validate(cfg: TrainConfig) -> None:
    """Fail fast, with the fix in the message, on anything that would break after compute has started."""
    err = []
    if cfg.model is not None and not Path(cfg.model).is_dir():
        err.append(f"--model {cfg.model!r} is not a directory; pass a local checkpoint saved with save_pretrained "
                   "(no hub downloads at run time), or drop --model to train from --model_config.")
    elif cfg.model is not None and not (Path(cfg.model) / "config.json").is_file():
        err.append(f"--model {cfg.model!r} has no config.json; is it a save_pretrained checkpoint?")
    if cfg.model is None and cfg.model_config is None:
        err.append("give --model PATH (continued pretraining) or --model_config YAML/JSON (from scratch).")
    if isinstance(cfg.model_config, str):
        if not Path(cfg.model_config).is_file():
            err.append(f"--model_config {cfg.model_config!r} does not exist.")
    elif cfg.model_config is not None:
        if not isinstance(cfg.model_config, dict) or "model_type" not in cfg.model_config:
            err.append("model_config must be a mapping with a 'model_type' key (e.g. qwen3_5_text, qwen3_next, qwen3).")
        elif cfg.model is None and cfg.attn == "deltamatch_fp8":
            mc = cfg.model_config
            hd = mc.get("head_dim") or (mc.get("hidden_size", 0) // max(1, mc.get("num_attention_heads", 1)))
            if hd and hd % 16:
                err.append(f"deltamatch_fp8 needs head_dim % 16 == 0; model_config gives head_dim {hd}.")
    if cfg.attn not in ATTN_CHOICES and not _registered_attention(cfg.attn):
        err.append(f"--attn {cfg.attn!r}: choose one of {list(ATTN_CHOICES)}, or register your own with "
                   "transformers.AttentionInterface.register before parsing the config.")
    if cfg.precision not in ("fp8", "bf16", "fp8_fwd", "fp8_bwd"):
        err.append(f"--precision {cfg.precision!r}: choose fp8 or bf16 (or the ablations fp8_fwd: fp8 forward with "
                   "bf16 backward, fp8_bwd: bf16 forward with fp8 backward).")
    if cfg.delta not in ("matching", "stale"):
        err.append(f"--delta {cfg.delta!r}: choose matching or stale.")
    if cfg.optimizer not in ("adamw", "muon"):
        err.append(f"--optimizer {cfg.optimizer!r}: choose adamw or muon.")
    if cfg.mixed_precision not in ("bf16", "no"):
        err.append(f"--mixed_precision {cfg.mixed_precision!r}: choose bf16 or no.")
    if cfg.data_format not in ("auto", "text", "json", "parquet", "hub"):
        err.append(f"--data_format {cfg.data_format!r}: choose auto, text, json, parquet or hub.")
    for name in ("seq_len", "batch_size", "grad_accum", "max_steps", "log_every", "eval_every", "save_every",
                 "eval_batches", "vocab_size"):
        if getattr(cfg, name) <= 0:
            err.append(f"--{name} must be positive, got {getattr(cfg, name)}.")
    if cfg.seq_len < 2:
        err.append("--seq_len must be at least 2.")
    if not 0.0 <= cfg.val_fraction < 1.0:
        err.append(f"--val_fraction must be in [0, 1), got {cfg.val_fraction}.")
    if cfg.lr <= 0 or not 0 <= cfg.min_lr_ratio <= 1:
        err.append("--lr must be > 0 and --min_lr_ratio in [0, 1].")
    if cfg.warmup_steps < 0 or cfg.loss_chunk < 0 or cfg.max_minutes < 0:
        err.append("--warmup_steps, --loss_chunk and --max_minutes must be >= 0.")
    if cfg.attn_stats < 0:
        err.append(f"--attn_stats must be >= 0 (0 = off, N = every N steps), got {cfg.attn_stats}.")
    elif cfg.attn_stats and cfg.attn == "eager":
        err.append("--attn_stats reads q, k, v through transformers' attention interface, which 'eager' bypasses; "
                   "use --attn sdpa (same numerics) or deltamatch_fp8.")
    if not (isinstance(cfg.adam_betas, (list, tuple)) and len(cfg.adam_betas) == 2):
        err.append(f"--adam_betas must be two numbers, e.g. '[0.9, 0.95]', got {cfg.adam_betas!r}.")
    if cfg.rope_scaling is not None and not isinstance(cfg.rope_scaling, dict):
        err.append("--rope_scaling must be a JSON object, e.g. '{\"rope_type\": \"yarn\", \"factor\": 8}'.")
    if cfg.lora is not None:
        try:
            parse_lora(cfg.lora)
        except ConfigError as e:
            err.append(str(e))
    if cfg.tokenizer != "train":
        tok = Path(cfg.tokenizer)
        if not tok.is_dir():
            err.append(f"--tokenizer {cfg.tokenizer!r} is not a local directory; give a saved tokenizer dir or "
                       "'train' to train a BPE tokenizer on the training data.")
    elif cfg.model is not None and (Path(cfg.model) / "tokenizer.json").is_file():
        pass  # load_tokenizer picks the checkpoint's tokenizer
    from .tasks import is_task, task_of

    if is_task(cfg.data):
        try:
            task_of(cfg)
        except ConfigError as e:
            err.append(str(e))
        if cfg.data_seed < 0:
            err.append(f"--data_seed must be >= 0 for the generated task {cfg.data}, got {cfg.data_seed}.")
        if cfg.seq_len < 3:
            err.append(f"--data {cfg.data}: every sequence is <bos>, tokens and <|endoftext|>: --seq_len must be "
                       f"at least 3, got {cfg.seq_len}.")
    elif cfg.task is not None:
        err.append(f"--task sets the parameters of a generated task, but --data {cfg.data!r} is none; use --data "
                   "bigram_backcopy or drop --task.")
    if cfg.data != "stdlib" and cfg.data_format != "hub" and not is_task(cfg.data):
        for pattern in ([cfg.data] if isinstance(cfg.data, str) else list(cfg.data)):
            if _looks_like_hub_name(pattern) and cfg.data_format == "auto":
                continue
            import glob

            if not glob.glob(str(pattern), recursive=True):
                err.append(f"--data {pattern!r} matches no file. Give local .txt/.jsonl/.json/.parquet files "
                           "(globs allowed), 'stdlib' for the offline corpus, 'bigram_backcopy' for the generated "
                           "sinks task, or a hub dataset name with "
                           "--data_format hub when online.")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_dir():
        err.append(f"--resume {cfg.resume!r} is not a checkpoint directory (use 'auto' for the latest in output_dir).")
    if cfg.compile_fp8_linear and not cfg.fp8_linear:
        err.append("--compile_fp8_linear compiles the float8 linears of --fp8_linear: pass both, or neither.")
    if cfg.fp8_linear:
        import importlib.util

        if importlib.util.find_spec("torchao") is None:
            err.append("--fp8_linear needs torchao (pip install torchao matching your torch).")
    if err:
        raise ConfigError("invalid training config:\n  - " + "\n  - ".join(err))


def _looks_like_hub_name(s: str) -> bool:
    return "/" in s and not os.path.exists(s) and not any(ch in s for ch in "*?") and \
        not s.endswith((".txt", ".json", ".jsonl", ".parquet")) and not s.startswith((".", "/"))


def parse_lora(spec: str) -> tuple[int, int, list[str]]:
    """'r,alpha,target,...' -> (r, alpha, targets)."""
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    try:
        r, alpha = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ConfigError(f"--lora {spec!r}: expected 'r,alpha,target1[,target2...]', e.g. '8,16,q_proj,v_proj'.")
    targets = parts[2:]
    if not targets or r <= 0:
        raise ConfigError(f"--lora {spec!r}: give a positive rank and at least one target module name.")
    return r, alpha, targets
