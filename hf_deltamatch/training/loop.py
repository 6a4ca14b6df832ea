"""The training loop of the recipes (accelerate): bf16 autocast, gradient accumulation, clipping, warmup+cosine,
periodic validation CE, checkpoints with exact resume, tqdm, TensorBoard + JSONL logs, Ctrl-C saves."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from .config import ConfigError, TrainConfig, parse_config

log = logging.getLogger("hf_deltamatch.training")


class TrainState:
    """Position of the run, saved with accelerator.save_state (register_for_checkpointing)."""

    def __init__(self):
        self.step = 0  # optimizer steps done
        self.epoch = 0
        self.batches_in_epoch = 0  # micro-batches of `epoch` consumed by completed optimizer steps
        self.micro = 0  # micro-batches consumed in total
        self.tokens = 0  # predicted tokens seen (all processes)
        self.elapsed = 0.0  # training seconds before this process started

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, d):
        for k, v in d.items():
            setattr(self, k, v)


class _StopFlag:
    """SIGINT/SIGTERM ask the loop to stop after the current optimizer step (then it checkpoints).
    A second Ctrl-C interrupts at once."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\n[hf_deltamatch] signal {signum}: saving a checkpoint after this step (Ctrl-C again to abort)",
              file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _memory_gb(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB -> GiB (process peak RSS)


def _checkpoints(output_dir: Path) -> list[Path]:
    d = output_dir / "checkpoints"
    return sorted((p for p in d.glob("step_*") if (p / "DONE").is_file()), key=lambda p: int(p.name.split("_")[1]))


def _hparams(cfg: TrainConfig) -> dict:
    out = {}
    for k, v in cfg.to_dict().items():
        out[k] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
    return out


def train(cfg: TrainConfig) -> dict:
    """Run one recipe end to end; returns the summary also written to output_dir/summary.json."""
    threads = torch.get_num_threads()
    if cfg.cpu_threads > 0 and not torch.cuda.is_available():
        torch.set_num_threads(cfg.cpu_threads)
    try:
        return _train(cfg)
    finally:
        torch.set_num_threads(threads)
        _console_logging(None)


def _drop_tied_copies(models, weights, output_dir) -> None:
    """accelerate's save_state pre-hook: keep one name per tensor in the state dicts it saves.

    Tied weights (the LM head sharing the embedding) appear under two names of one tensor. safetensors cannot store
    aliases, so accelerate drops the later names itself, with a warning to check that reloading restores them; it
    does (safetensors' load_model re-derives the ties from the model, and resuming continues bit-identically,
    tests/test_recipe_train.py). This drops the same names first, so the saved files are the same."""
    for state_dict in weights:
        seen = set()
        for name in list(state_dict):
            t = state_dict[name]
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key in seen:
                del state_dict[name]
            else:
                seen.add(key)


class _ConsoleHandler(logging.Handler):
    """The run's report: INFO lines to stdout (beside the progress bar's validation lines), warnings to stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _console_logging(main: bool | None) -> None:
    """Print hf_deltamatch's log records during a run: INFO and up on the main process, warnings elsewhere; `None`
    restores the logger. Only hf_deltamatch's: the libraries' INFO records (accelerate's checkpoint lines) are not
    the run's report, and their warnings reach stderr through logging's last-resort handler as before. Where the
    application has configured logging (a root handler), records go there instead, as with logging.basicConfig."""
    pkg = logging.getLogger("hf_deltamatch")
    ours = [h for h in pkg.handlers if isinstance(h, _ConsoleHandler)]
    if main is None:
        for h in ours:
            pkg.removeHandler(h)
        pkg.setLevel(_console_logging.saved_level)
        return
    if not ours:
        _console_logging.saved_level = pkg.level
        if not logging.getLogger().handlers:
            handler = _ConsoleHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            pkg.addHandler(handler)
    pkg.setLevel(logging.INFO if main else logging.WARNING)


_console_logging.saved_level = logging.NOTSET


def _train(cfg: TrainConfig) -> dict:
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    from .data import build_dataloaders, load_text_splits, load_tokenizer, tokenizer_training_texts
    from .attn_stats import AttentionStats
    from .modeling import CausalLMWithLoss, backward_numerics, build_model, causal_lm
    from .optim import build_optimizers, build_schedulers
    from .tasks import task_of

    out_dir = Path(cfg.output_dir)
    cpu_fsdp = _cpu_fsdp_rehearsal()
    accelerator = Accelerator(
        mixed_precision=cfg.mixed_precision,
        log_with="tensorboard",
        project_dir=str(out_dir),
        # Every rank collates its own packed batches (the flattened (1, tokens) layout cannot be split by
        # accelerate's batch dispatcher).
        dataloader_config=DataLoaderConfiguration(dispatch_batches=False),
        step_scheduler_with_optimizer=False,
        # Without a GPU, say so explicitly: accelerate then runs multi-process (torchrun/accelerate launch) as
        # CPU DDP over gloo instead of silently starting independent single-process runs.
        cpu=not torch.cuda.is_available() and not cpu_fsdp,
    )
    if accelerator.distributed_type.name == "FSDP":
        _fsdp_mixed_precision(accelerator)
    accelerator.register_save_state_pre_hook(_drop_tied_copies)
    main = accelerator.is_main_process
    _console_logging(main)
    set_seed(cfg.seed)

    resume_dir = None
    if cfg.resume == "auto":
        found = _checkpoints(out_dir)
        resume_dir = found[-1] if found else None
    elif cfg.resume:
        resume_dir = Path(cfg.resume)
        if not (resume_dir / "DONE").is_file():
            raise ConfigError(f"--resume {resume_dir} is not a complete checkpoint (no DONE marker).")

    # ---- data + tokenizer (main process first: it builds caches the others then reuse) ----------------
    with accelerator.main_process_first():
        out_dir.mkdir(parents=True, exist_ok=True)
        train_text, val_text = load_text_splits(cfg)
        tokenizer = load_tokenizer(cfg, tokenizer_training_texts(train_text))
        train_dl, val_dl, n_blocks = build_dataloaders(cfg, tokenizer, train_text, val_text)
    if main:
        import yaml

        (out_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    # ---- model + optimizers ----------------------------------------------------------------------------
    if cfg.optimizer == "muon" and accelerator.distributed_type.name == "FSDP":
        raise ConfigError("--optimizer muon orthogonalizes whole weight matrices; FSDP shards them. Use DDP "
                          "(recipes/configs/accelerate/ddp.yaml) or AdamW with FSDP.")
    model = build_model(cfg, tokenizer)
    wrapped = CausalLMWithLoss(model, cfg.loss_chunk)
    optimizers = build_optimizers(wrapped, cfg)
    schedulers = build_schedulers(optimizers, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    prepared = accelerator.prepare(wrapped, *optimizers, *schedulers, train_dl,
                                   *([val_dl] if val_dl is not None else []))
    wrapped = prepared[0]
    optimizers = list(prepared[1:1 + len(optimizers)])
    schedulers = list(prepared[1 + len(optimizers):1 + 2 * len(optimizers)])
    train_dl = prepared[1 + 2 * len(optimizers)]
    val_dl = prepared[2 + 2 * len(optimizers)] if val_dl is not None else None
    state = TrainState()
    accelerator.register_for_checkpointing(state)
    if resume_dir is not None:
        accelerator.load_state(str(resume_dir))
        log.info("resumed from %s at step %d", resume_dir, state.step)
    start_step = state.step

    if accelerator.distributed_type.name == "FSDP" and main:
        log.info("FSDP%s: %s", getattr(accelerator.state.fsdp_plugin, "fsdp_version", "?"), _fsdp_layout(wrapped))
    if main:
        log.info("model %s: %.2fM params (%.2fM trainable), attn=%s precision=%s delta=%s; %s blocks of %d "
                 "tokens; %d process(es) on %s, mixed precision %s",
                 type(causal_lm(accelerator.unwrap_model(wrapped).model)).__name__,
                 n_params / 1e6, n_train / 1e6, cfg.attn, cfg.precision, cfg.delta,
                 n_blocks if n_blocks is not None else "streamed", cfg.seq_len, accelerator.num_processes,
                 accelerator.device, accelerator.mixed_precision)
    accelerator.init_trackers(cfg.name, config=_hparams(cfg))
    metrics_path = out_dir / "metrics.jsonl"
    if main:
        _truncate_metrics(metrics_path, state.step)

    def write(rec: dict, scalars: dict | None = None):
        """One metrics.jsonl line; TensorBoard gets `scalars`, by default the record's numbers."""
        if main:
            with metrics_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        accelerator.log(scalars if scalars is not None else {k: v for k, v in rec.items() if k not in ("step", "kind")},
                        step=rec["step"])

    # the main process measures attention every cfg.attn_stats steps (training/attn_stats.py)
    monitor = None
    if cfg.attn_stats and main:
        impl = causal_lm(accelerator.unwrap_model(wrapped).model).config._attn_implementation
        monitor = AttentionStats(impl, cfg.attn_stats, *backward_numerics(cfg))

    def write_attn_stats(rows: list[dict]):
        for row in rows:
            rec = {"kind": "attn", "step": state.step, "tokens": state.tokens, **row}
            write(rec, {f"attn/layer{row['layer']}/{k}": v for k, v in row.items()
                        if k not in ("layer", "head") and v is not None})

    task = task_of(cfg)

    def evaluate() -> dict | None:
        """{"val_loss": CE over all predicted tokens}, and for a generated task its accuracy on the target tokens
        (val_acc), their CE (val_target_loss) and their number (val_targets)."""
        if val_dl is None:
            return None
        wrapped.eval()
        tot = torch.zeros(5, dtype=torch.float64, device=accelerator.device)
        with torch.no_grad():
            for i, batch in enumerate(val_dl):
                if i >= cfg.eval_batches:
                    break
                with accelerator.autocast():
                    if task is None:
                        loss, n = wrapped(**batch)
                    else:
                        loss, n, target = wrapped(**batch, scored=task.scored_positions(batch["input_ids"], tokenizer))
                        tot[2:] += target
                tot[:2] += torch.stack([loss.double() * n, n.double()])
        wrapped.train()
        tot = accelerator.reduce(tot, reduction="sum")
        out = {"val_loss": (tot[0] / tot[1].clamp(min=1)).item()}
        if task is not None:
            count = tot[4].clamp(min=1)
            out.update(val_acc=(tot[3] / count).item(), val_target_loss=(tot[2] / count).item(),
                       val_targets=int(tot[4].item()))
        return out

    def save_checkpoint():
        ckpt = out_dir / "checkpoints" / f"step_{state.step:07d}"
        accelerator.save_state(str(ckpt))
        accelerator.wait_for_everyone()
        if main:
            (ckpt / "DONE").write_text(json.dumps(state.state_dict()))  # marks the checkpoint complete
            for old in _checkpoints(out_dir)[:-cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return ckpt

    # ---- loop --------------------------------------------------------------------------------------------
    wrapped.train()
    bar = tqdm(total=cfg.max_steps, initial=state.step, disable=not main, desc=cfg.name, dynamic_ncols=True)
    t_start = time.time() - state.elapsed
    t_window, tok_window, state_tokens_logged = time.time(), 0, 0
    loss_acc = torch.zeros((), device=accelerator.device)
    n_acc = 0
    last_val = last_eval = None
    stopped = time_limited = False
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    attn_rows = []
    with _StopFlag() as stop, (monitor if monitor is not None else contextlib.nullcontext()):
        while state.step < cfg.max_steps and not stopped and not time_limited:
            train_dl.set_epoch(state.epoch)
            skip = state.batches_in_epoch
            epoch_dl = accelerator.skip_first_batches(train_dl, skip) if skip else train_dl
            micro_in_step = 0
            for batch in epoch_dl:
                sync = micro_in_step == cfg.grad_accum - 1
                ctx = accelerator.no_sync(wrapped) if not sync else _null()
                if monitor is not None and micro_in_step == 0 and monitor.due(state.step + 1):
                    monitor.arm(state.step + 1)
                with ctx, accelerator.autocast():
                    loss, _ = wrapped(**batch)
                    accelerator.backward(loss / cfg.grad_accum)
                if monitor is not None and monitor.armed_step is not None:
                    attn_rows = monitor.collect()
                loss_acc += loss.detach()
                n_acc += 1
                # input tokens: the same count on every rank (fixed-length blocks), so no communication needed
                tok_window += batch["input_ids"].numel() * accelerator.num_processes
                micro_in_step += 1
                if not sync:
                    continue
                micro_in_step = 0
                grad_norm = accelerator.clip_grad_norm_(wrapped.parameters(), cfg.clip_grad) \
                    if cfg.clip_grad > 0 else None
                for opt in optimizers:
                    opt.step()
                for sch in schedulers:
                    sch.step()
                for opt in optimizers:
                    opt.zero_grad(set_to_none=True)
                state.step += 1
                state.batches_in_epoch += cfg.grad_accum
                state.micro += cfg.grad_accum
                state.tokens += tok_window - state_tokens_logged
                state_tokens_logged = tok_window
                bar.update(1)

                out_of_time = cfg.max_minutes > 0 and time.time() - t_start > cfg.max_minutes * 60
                if accelerator.num_processes > 1 and cfg.max_minutes > 0:  # ranks must agree on the last step
                    out_of_time = accelerator.reduce(torch.tensor(float(out_of_time), device=accelerator.device),
                                                     "sum").item() > 0
                if out_of_time:
                    time_limited = True

                if state.step % cfg.log_every == 0 or state.step == cfg.max_steps or out_of_time:
                    mean_loss = accelerator.reduce(loss_acc / max(n_acc, 1), reduction="mean")
                    now = time.time()
                    tokens_window = tok_window
                    rec = {
                        "kind": "train", "step": state.step, "tokens": state.tokens,
                        "loss": mean_loss.item(),
                        "lr": schedulers[0].get_last_lr()[0],
                        "grad_norm": float(grad_norm) if grad_norm is not None else None,
                        "tokens_per_s": tokens_window / max(now - t_window, 1e-9),
                        "mem_gb": _memory_gb(accelerator.device),
                        "elapsed_s": now - t_start,
                    }
                    if not math.isfinite(rec["loss"]):
                        log.warning("non-finite loss at step %d", state.step)
                    write(rec)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.1e}",
                                    tok_s=f"{rec['tokens_per_s']:.0f}")
                    loss_acc.zero_()
                    n_acc, tok_window, state_tokens_logged, t_window = 0, 0, 0, time.time()

                if attn_rows:
                    write_attn_stats(attn_rows)
                    attn_rows = []

                if state.step % cfg.eval_every == 0 or state.step == cfg.max_steps or out_of_time:
                    last_eval = evaluate()
                    if last_eval is not None:
                        last_val = last_eval["val_loss"]
                        write({"kind": "eval", "step": state.step, "tokens": state.tokens, **last_eval})
                        acc = f", target accuracy {last_eval['val_acc']:.4f}" if "val_acc" in last_eval else ""
                        bar.write(f"step {state.step}: val CE {last_val:.4f}{acc}") if main else None

                stop_now = stop.requested
                if accelerator.num_processes > 1:  # every rank must agree to stop at the same step
                    flag = accelerator.reduce(torch.tensor(float(stop_now), device=accelerator.device), "sum")
                    stop_now = flag.item() > 0
                state.elapsed = time.time() - t_start
                if stop_now or out_of_time or state.step % cfg.save_every == 0 or state.step == cfg.max_steps:
                    ckpt = save_checkpoint()
                    if stop_now:
                        bar.write(f"stopped at step {state.step}; checkpoint {ckpt}; continue with --resume auto") \
                            if main else None
                        stopped = True
                if stopped or out_of_time or state.step >= cfg.max_steps:
                    break
            else:
                state.epoch += 1
                state.batches_in_epoch = 0
                if micro_in_step:  # an epoch ended inside an accumulation window: drop the partial gradients
                    for opt in optimizers:
                        opt.zero_grad(set_to_none=True)
                    loss_acc.zero_()
                    n_acc = 0
    bar.close()

    # ---- final -------------------------------------------------------------------------------------------
    accelerator.wait_for_everyone()
    summary = {"name": cfg.name, "steps": state.step, "tokens": state.tokens, "elapsed_s": time.time() - t_start,
               "final_val_loss": last_val, "attn": cfg.attn, "precision": cfg.precision, "delta": cfg.delta,
               "interrupted": stopped, "time_limited": time_limited, "params": n_params, "trainable_params": n_train,
               "num_processes": accelerator.num_processes, "start_step": start_step,
               "attn_stats_s": monitor.seconds if monitor is not None else None}
    if last_eval is not None and "val_acc" in last_eval:
        summary.update(final_val_acc=last_eval["val_acc"], final_val_target_loss=last_eval["val_target_loss"])
    if main:
        records = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()]
        train_recs = [r for r in records if r.get("kind") == "train"]
        if train_recs:
            summary["final_train_loss"] = train_recs[-1]["loss"]
            summary["first_train_loss"] = train_recs[0]["loss"]
            tps = [r["tokens_per_s"] for r in train_recs[1:]] or [train_recs[0]["tokens_per_s"]]
            summary["tokens_per_s"] = sum(tps) / len(tps)
            summary["mem_gb"] = max(r["mem_gb"] for r in train_recs)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if cfg.save_final and not stopped:
        # get_state_dict is collective (FSDP gathers full weights); only the main process writes.
        full = accelerator.get_state_dict(wrapped)
        if main:
            final = out_dir / "final"
            inner = accelerator.unwrap_model(wrapped).model
            sd = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
            inner.save_pretrained(str(final), state_dict=sd)  # a LoRA run saves just the adapter
            tokenizer.save_pretrained(str(final))
    accelerator.end_training()
    return summary


def _fsdp_mixed_precision(accelerator) -> None:
    """FSDP2 with --mixed_precision bf16: bf16 parameters for compute (the all-gathers move half the bytes), but
    fp32 gradient reduction and fp32 outputs, so the loss and the averaged gradients match DDP's precision.
    (accelerate's default for bf16 is bf16 everywhere: gradients reduce-scattered in bf16 and the loss returned
    rounded to bf16.) fp32 master weights and the optimizer state stay fp32 either way."""
    plugin = accelerator.state.fsdp_plugin
    if accelerator.mixed_precision != "bf16" or getattr(plugin, "fsdp_version", 1) != 2:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                         output_dtype=torch.float32)


def _fsdp_layout(model) -> str:
    """What FSDP did to the model: sharded units and activation-checkpointed blocks (for the run log)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        return "?"
    units = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]
    ckpt = sum(1 for m in model.modules() if type(m).__name__.endswith("CheckpointWrapper"))
    kinds = ", ".join(f"{units.count(k)} x {k}" for k in dict.fromkeys(units))
    return f"{len(units)} fully_shard units ({kinds}); activation checkpointing on {ckpt} modules"


def _cpu_fsdp_rehearsal() -> bool:
    """HF_DELTAMATCH_CPU_FSDP=1 (tests, `multi_gpu_runs.sh` with SMOKE=1): run accelerate's real FSDP2 path on
    CPU processes over gloo. accelerate only enables FSDP for accelerator devices (on CPU it silently falls
    back to DDP), while torch's fully_shard itself works on CPU; so under a multi-process launch with FSDP
    configured and no GPU, this makes accelerate see a "multi-GPU" gloo group whose device is the CPU.
    Returns True when it did so. Never active with a GPU."""
    if os.environ.get("HF_DELTAMATCH_CPU_FSDP") != "1" or torch.cuda.is_available():
        return False
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or int(os.environ.get("WORLD_SIZE", 1)) < 2:
        return False
    import accelerate.state as acc_state
    from accelerate.utils import DistributedType

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        return "gloo", DistributedType.MULTI_GPU

    acc_state.PartialState._prepare_backend = prepare_backend
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    return True


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume, drop records written after the checkpoint (an interrupted tail) so curves do not fork."""
    if not path.is_file():
        return
    keep = [x for x in path.read_text().splitlines() if x.strip() and json.loads(x)["step"] <= step]
    path.write_text("".join(k + "\n" for k in keep))


def main(argv: list[str] | None = None, base: dict | None = None, description: str | None = None) -> int:
    from .config import build_parser
    from .sweep import parse_seeds, run_seeds

    try:
        cfg = parse_config(argv, base=base, description=description)
        seeds_arg = build_parser().parse_known_args(argv)[0].seeds
        if seeds_arg is not None:
            try:
                seeds = parse_seeds(seeds_arg)
            except ValueError as e:
                raise ConfigError(str(e))
            summaries = run_seeds(cfg, seeds)
        else:
            summaries = [train(cfg)]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 130 if summaries[-1].get("interrupted") else 0
