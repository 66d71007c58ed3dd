"""Which models ``rollout.exact`` covers, decided from their HF ``config.json`` (torch-free: config validation asks).

Exact mode (:mod:`posttrain.core.exact`) gives the engine and the trainer one arithmetic for decoders made of:
multi-head or grouped-query attention (q/k/v biases, per-head q/k RMSNorms, rotary over the whole head or a part
of it, in halves or interleaved pairs, unscaled) or multi-head latent attention (keys and values expanded from
the latent cache, as the trainer computes them), RMSNorms before or around attention and MLP, SiLU-gated MLPs,
and MoE layers routed by softmax or sigmoid scores (renormalized, scaled, an expert bias, group-limited choice)
with ungated shared experts. :func:`uncovered` names each part of a config beyond that; :func:`exact_errors` is
config validation's part for ``rollout.exact`` (a backend's own limits, such as tensor or expert parallelism or
compiled layers, are its ``check_config``'s).
"""

from __future__ import annotations

from typing import Any

SILU = ("silu", "swish")


def exact_errors(run: Any, plugins: Any) -> list[str]:
    """What keeps ``rollout.exact`` from holding in run config ``run``, one line each: backends without an exact
    mode, a sampling temperature (the engine divides the logits by ``T``, the trainer scales its last hidden state
    by ``1 / T``: equal in exact arithmetic, not in the last bit), each part of the model it does not cover."""
    if not run.rollout.exact:
        return []
    registries = plugins.registries()
    errors = []
    for c, kind in ((run.rollout.engine, "engine"), (run.trainer.backend, "trainer")):
        if not getattr(c.cls, "exact_mode", False):
            have = sorted(n for n, cls in registries[f"{kind}s"].items() if getattr(cls, "exact_mode", False))
            errors.append(f"rollout.exact: the {c.name} {kind} has no exact mode ({kind}s with one: "
                          f"{', '.join(have) or 'none'})")
    if run.rollout.temperature not in (0.0, 1.0):
        errors.append(f"rollout.exact: needs rollout.temperature 1.0 (or 0, greedy), got {run.rollout.temperature}: "
                      f"the engine's z / T and the trainer's (h / T) W^T differ in the last bit")
    return errors + _dtype_errors(run) + _model_errors(run, plugins)


def _dtype_errors(run: Any) -> list[str]:
    """The engine must compute in the trainer's dtype (``model.dtype``): an explicit other ``rollout.engine.dtype``,
    or ``auto`` on the CPU (float32 there) under a half-precision trainer, is one line."""
    engine = getattr(run.rollout.engine, "config", None)
    want = getattr(getattr(run.model, "config", None), "dtype", None)
    have = getattr(engine, "dtype", None)
    if want is None or have is None:
        return []
    if have == "auto" and str(getattr(engine, "device", "cpu")) == "cpu":
        have = "float32"
    if have not in ("auto", want):
        return [f"rollout.exact: the engine computes in {have} (rollout.engine.dtype), the trainer in {want} "
                f"(model.dtype): set rollout.engine.dtype: {want}"]
    return []


def _model_errors(run: Any, plugins: Any) -> list[str]:
    """One line per part of the model's architecture exact mode does not cover (from its HF config; a config that
    cannot be read is the model section's own error)."""
    from posttrain.core.errors import ConfigError, UsageError

    if run.model is None:
        return []
    try:
        hf = run.model.create(plugins).hf_config()
    except (ConfigError, UsageError, OSError, ValueError):
        return []
    covered = ", ".join(covered_models(plugins.models)) or "none"
    return [f"rollout.exact: model {run.model.name} has {what}, which exact mode does not cover (covered: {covered})"
            for what in uncovered(hf)]


def uncovered(hf: dict[str, Any]) -> list[str]:
    """What HF config ``hf`` has that exact mode does not cover, one phrase each ("yarn rope scaling
    (rope_scaling)"); empty when it covers the whole model. Rope scaling: exact mode aligns only unscaled rotary
    tables between the engine's device and the trainer's."""
    out = []
    act = hf.get("hidden_act", "silu")
    if act not in SILU:
        out.append(f"a {act} activation (hidden_act; exact mode computes SiLU)")
    for key in ("rope_scaling", "rope_parameters"):
        rope = hf.get(key)
        kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
        if kind not in (None, "default"):
            out.append(f"{kind} rope scaling ({key})")
            break
    if hf.get("use_sliding_window"):
        out.append("sliding-window attention (use_sliding_window)")
    if hf.get("scoring_func") not in (None, "softmax", "sigmoid"):
        out.append(f"{hf['scoring_func']} expert scores (scoring_func)")
    return out


def covered_models(models: dict[str, Any]) -> list[str]:
    """Names of the registered model specs (``name -> class``) of one family (not ``generic``: those take any
    architecture from a checkpoint) whose every preset :func:`uncovered` finds nothing in."""
    return sorted(name for name, cls in models.items() if getattr(cls, "presets", None) and not getattr(
        cls, "generic", False) and not any(uncovered(p) for p in cls.presets.values()))
