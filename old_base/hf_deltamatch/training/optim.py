"""Optimizers and the LR schedule.

AdamW, or Muon (torch.optim.Muon, torch >= 2.9) for the 2-D weight matrices of the hidden layers with AdamW for
everything Muon is not meant for (embeddings, LM head, norms, biases, convolutions, gates): the split the
Muon authors and the paper's Muon runs use. Schedule: linear warmup then cosine to min_lr_ratio * lr.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import ConfigError, TrainConfig

_NO_DECAY = ("bias", "norm", "A_log", "dt_bias")


def _is_embedding_or_head(name: str, model: nn.Module) -> bool:
    return any(k in name for k in ("embed_tokens", "lm_head", "wte", "word_embeddings"))


def param_groups(model: nn.Module, cfg: TrainConfig):
    """(muon_params, adamw_decay, adamw_no_decay) over trainable parameters (muon_params empty for adamw)."""
    muon, decay, no_decay = [], [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))  # tied weights appear once
        lname = name.lower()
        if cfg.optimizer == "muon" and p.ndim == 2 and not _is_embedding_or_head(name, model):
            muon.append(p)
        elif p.ndim < 2 or any(k.lower() in lname for k in _NO_DECAY):
            no_decay.append(p)
        else:
            decay.append(p)
    return muon, decay, no_decay


def build_optimizers(model: nn.Module, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    muon, decay, no_decay = param_groups(model, cfg)
    if not (muon or decay or no_decay):
        raise ConfigError("the model has no trainable parameters.")
    groups = [g for g in ({"params": decay, "weight_decay": cfg.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    opts = []
    if groups:
        opts.append(torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=1e-8))
    if muon:
        if not hasattr(torch.optim, "Muon"):
            raise ConfigError("--optimizer muon needs torch.optim.Muon (torch >= 2.9); this torch is "
                              f"{torch.__version__}.")
        # match_rms_adamw scales Muon's orthogonalized update to AdamW's RMS so one --lr serves both groups.
        opts.append(torch.optim.Muon(muon, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                                     adjust_lr_fn="match_rms_adamw"))
    return opts


def lr_lambda(cfg: TrainConfig):
    warm, total, floor = cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def build_schedulers(optimizers, cfg: TrainConfig):
    return [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(cfg)) for o in optimizers]
