"""The run config: one YAML file, a section per concern, dotted overrides, every error at once.

::

    estimator: {name: grpo, epsilon: 1.0e-6}      # component sections select by name ...
    rewards: [{name: exact_match, weight: 1.0}]   # ... and pass the other keys to its Config
    rollout: {rollout_batch_size: 8, n_samples_per_prompt: 8}
    trainer: {global_batch_size: 64, steps_per_rollout: 1}

``load_config(path, overrides, plugins)`` returns a :class:`RunConfig` or raises :class:`ConfigError`
with every problem found, each with its dotted path. Nothing starts before this passes.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from posttrain.core.config_source import apply_overrides, moved_keys, read_yaml, resolve_files
from posttrain.core.errors import ConfigError
from posttrain.core.exact_scope import exact_errors
from posttrain.core.interfaces import needs_of
from posttrain.core.lora import LoraConfig
from posttrain.core.registry import KINDS
from posttrain.core.rewards import RewardRunnerConfig
from posttrain.core.watchdog import WatchdogConfig
from posttrain.core.schema import build, option, to_dict
from posttrain.core.selection import Selection, component


@dataclass
class DataConfig:
    """Prompt data (``posttrain.core.data``)."""

    path: str | None = option(None, help="prompt dataset (.jsonl/.json/.parquet or a saved HF dataset); path@[a:b] slices")
    input_key: str = option("prompt", help="key holding the prompt (a string or chat messages)")
    label_key: str = option("label", help="key holding the reference answer")
    metadata_key: str = option("metadata", help="key holding per-sample metadata (a mapping)")
    tools_key: str = option("tools", help="key holding tool schemas (a list or a JSON string); -> metadata['tools']")
    apply_chat_template: bool = option(False, help="the chat-template switch: render string prompts as a user "
                                                   "message with the model's chat template (add_generation_prompt="
                                                   "True); chat-message prompts always are")
    system_prompt: str | None = option(None, help="a system message put before each prompt (a string prompt becomes "
                                                  "a system and a user message; chat prompts keep their own "
                                                  "system message)")
    chat_template_kwargs: dict[str, Any] = option(default_factory=dict,
                                                  help="extra keyword arguments for apply_chat_template")
    max_prompt_len: int | None = option(None, ge=1, help="drop prompts longer than this many tokens (a prompt's "
                                                         "image tokens count)")
    images_key: str | None = option(None, help="key holding a prompt's images (vision-language models): a path "
                                               "relative to the data file, a base64 string (or data: URL), or a "
                                               "list of them; the chat template places them")
    max_pixels: int | None = option(None, ge=1, help="a row with an image of more pixels (width x height) is a bad "
                                                     "row")
    on_bad_row: Literal["error", "skip"] = option("error", help="a malformed row stops the run, or is skipped "
                                                                "and counted")
    shuffle: bool = option(True, help="shuffle each epoch with seed + epoch")
    epochs: int = option(1, ge=1, help="passes over the prompts")
    over_sampling_batch_size: int | None = option(
        None, ge=1, help="prompt groups started at a time while the batch is not full (default rollout_batch_size)")
    max_sampled_groups: int | None = option(
        None, ge=1, help="dynamic sampling gives up after this many groups per rollout step "
                         "(default 8 x rollout_batch_size)")


@dataclass
class RolloutConfig:
    """Generation: how many prompts per step, how many samples each, how they are sampled."""

    rollout_batch_size: int = option(8, ge=1, help="prompts per rollout step")
    n_samples_per_prompt: int = option(8, ge=1, help="samples per prompt (the group size)")
    num_rollouts: int = option(100, ge=1, help="rollout steps in the run")
    temperature: float = option(1.0, ge=0.0, help="0: greedy; else at least 1e-5 (smaller ones overflow the logits)")
    top_p: float = option(1.0, gt=0.0, le=1.0, help="nucleus sampling: the smallest token set of this total probability")
    top_k: int = option(-1, help="-1 disables; else >= 1")
    max_new_tokens: int = option(128, ge=1, help="tokens generated per sample at most (a longer answer is truncated)")
    min_new_tokens: int = option(0, ge=0, help="tokens generated per sample at least: EOS and stops before then do "
                                               "not end it (SGLang's min_new_tokens; the distribution is not changed)")
    mode: Literal["sync", "async", "fully_async"] = option(
        "sync", help="async overlaps generation N+1 with training N; fully_async never stops generating: a "
                     "background producer fills a queue of finished groups, the trainer takes a batch as soon as "
                     "one is ready (staleness bounded by max_staleness)")
    async_buffer_size: int | None = option(
        None, ge=1, help="fully_async: finished plus in-flight prompt groups at most (default (max_staleness + 1) "
                         "x rollout_batch_size; at least rollout_batch_size)")
    update_weights_interval: int = option(1, ge=1, help="fully_async: push the weights to the engines every this "
                                                        "many train steps (and before each eval)")
    max_staleness: int = option(1, ge=0, help="fully_async: a sample whose oldest token is more than this many "
                                              "weight versions behind the trainer is not trained on (0: sync mode's "
                                              "samples); at least update_weights_interval - 1")
    stale: Literal["drop", "recompute"] = option("drop", help="fully_async: what happens to a group with a stale "
                                                              "sample: dropped (counted in rollout/dropped_stale), or "
                                                              "recompute (its prompt is generated again)")
    partial: bool = option(False, help="fully_async: requests in flight at a weight push are paused and continue "
                                       "from their partial tokens under the new weights (each token's version is "
                                       "recorded); off: they restart")
    min_p: float = option(0.0, ge=0.0, le=1.0, help="drop tokens below min_p x the top probability")
    stop: list[str] = option(default_factory=list, help="stop strings")
    stop_token_ids: list[int] = option(default_factory=list, help="stop token ids (EOS always stops)")
    engine: Any = component("engines", default=True, help="the engine backend and its options: "
                            "{name: local, device: cuda}; see `rl-cli plugins list --kind engine`")
    use_router: bool = option(True, help="route /generate through sglang-router")
    router_args: list[str] = option(default_factory=list, help="extra sglang_router.launch_router options")
    server_concurrency: int = option(512, ge=1, help="requests in flight per engine client")
    coalesce_rows: int = option(0, ge=0, help="send the /generate requests that rollouts make in the same instant "
                                              "as one batched request of at most this many rows (0: off); each "
                                              "row keeps its seed. A merged answer waits on its slowest row: for "
                                              "runs whose rows end together (short answers), not long tails")
    weight_sync: Literal["auto", "distributed", "tensor", "disk"] = option(
        "auto", help="how weights reach the engines: distributed (NCCL between GPUs, else Gloo), tensor (CUDA IPC "
                     "handles, same host), disk (an HF checkpoint); auto: tensor when GPU engines are colocated "
                     "or one is on a trainer GPU, else distributed (Gloo for colocated CPU engines too: tensor by "
                     "value on a CPU is slow; disk for engine backends without that mode)")
    weight_bucket_mb: int = option(512, ge=1, help="bucket size of a distributed weight update")
    check_weights: bool = option(False, help="after each push, every engine reports a checksum per tensor (SGLang: "
                                               "sampled tensors); a mismatch stops the run naming the first tensor")
    weight_sync_timeout_s: float = option(300.0, gt=0.0, help="bound on every HTTP call and collective of a weight "
                                                               "push: an engine that dies mid-push fails it this soon "
                                                               "(it is restarted and the push repeated)")
    exact: bool = option(False, help="exactly on-policy: the engine and the trainer compute with the same "
                                     "batch-invariant arithmetic (core.exact), so a sampled token's rollout "
                                     "log-prob equals the trainer's bit for bit (eager engine; slower); needs "
                                     "backends with an exact mode (local engine, megatron trainer)")
    seed_sampling: bool = option(False, help="give every sample its own sampling_seed, from the run's seed and the "
                                             "sample's index, so a rerun draws the same tokens (SGLang engines also "
                                             "need sglang: {enable_deterministic_inference: true})")

    def validate(self) -> list[str]:
        errors = sampling_errors(self.temperature, "temperature")
        if self.mode == "fully_async":
            size = self.async_buffer_size
            if size is not None and size < self.rollout_batch_size:
                errors.append(f"async_buffer_size: {size} groups cannot hold one batch (rollout_batch_size "
                              f"{self.rollout_batch_size})")
            if self.max_staleness < self.update_weights_interval - 1:
                errors.append(f"max_staleness: {self.max_staleness} is below update_weights_interval - 1 "
                              f"({self.update_weights_interval - 1}): samples between two pushes are that stale")
        else:
            errors += [f"{key}: only with rollout.mode: fully_async (it is {self.mode})"
                       for key, on in (("partial", self.partial), ("update_weights_interval",
                                       self.update_weights_interval != 1), ("stale", self.stale != "drop"),
                                       ("async_buffer_size", self.async_buffer_size is not None)) if on]
        if self.min_new_tokens > self.max_new_tokens:
            errors.append(f"min_new_tokens: {self.min_new_tokens} exceeds max_new_tokens ({self.max_new_tokens})")
        if self.top_k != -1 and not 1 <= self.top_k < 2**63:
            errors.append(f"top_k: {self.top_k} is out of range (-1 disables; else 1 <= top_k < 2**63)")
        return errors

    def weight_sync_mode(self, colocate: bool, shared_gpus: list[int] | tuple[int, ...] = (),
                         engines_on_gpu: bool = True) -> str:
        """``weight_sync`` with ``auto`` resolved: ``tensor`` (CUDA IPC) when GPU engines are colocated or sit on
        trainer GPUs (``shared_gpus``, from :func:`gpus_shared_with_trainer`: NCCL refuses two ranks on one GPU),
        else ``distributed`` (NCCL, or Gloo between CPU processes: colocated CPU engines too, since ``tensor`` on
        a CPU carries every weight by value in the HTTP body, a pickle and its base64, 87 s for Qwen3-0.6B's first
        push on a 2-core box and then the kernel's OOM killer, against 3.7 s over Gloo); when the engine
        backend's servers lack that mode (its ``weight_sync_modes``), ``disk`` (or its first mode)."""
        if self.weight_sync != "auto":
            return self.weight_sync
        mode = "tensor" if engines_on_gpu and (colocate or shared_gpus) else "distributed"
        modes = getattr(getattr(self.engine, "cls", None), "weight_sync_modes", None)
        if modes and mode not in modes:
            return "disk" if "disk" in modes else modes[0]
        return mode

    def sampling_params(self, seed: int | None = None, return_routed_experts: bool = False):
        """The run's :class:`~posttrain.core.types.SamplingParams`; ``seed`` (the run's) is kept only when
        ``seed_sampling`` is on; ``return_routed_experts`` when the trainer backend replays MoE routing."""
        from posttrain.core.types import SamplingParams

        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_new_tokens=self.max_new_tokens, stop=list(self.stop) or None,
                              stop_token_ids=list(self.stop_token_ids) or None,
                              seed=seed if self.seed_sampling else None,
                              seed_rows=self.seeds_batch_rows, return_routed_experts=return_routed_experts,
                              extra={"min_new_tokens": self.min_new_tokens} if self.min_new_tokens else {})

    @property
    def seeds_batch_rows(self) -> bool:
        """The engine backend seeds row ``j`` of a batch sharing one seeded ``sampling_params`` with ``seed + j``."""
        return bool(getattr(getattr(self.engine, "cls", None), "seeds_batch_rows", False))


@dataclass
class TrainerConfig:
    """The algorithm's optimization keys (every trainer backend honours them) and ``backend``, the trainer
    backend with its own keys (``{name: megatron, tp: 2}``)."""

    global_batch_size: int = option(64, ge=1, help="samples per optimizer step")
    micro_batch_size: int = option(8, ge=1, help="samples per forward/backward pass")
    max_tokens_per_micro_batch: int | Literal["auto"] | None = option(
        None, ge=1, help="dynamic micro-batches: consecutive samples up to this many tokens per forward/backward "
                         "pass (log-prob and train passes; micro_batch_size then no longer caps the count); "
                         "same loss and gradients as fixed micro-batches. auto: sized from the trainer device's "
                         "memory and the model's shape (core.micro_batch_plan), printed at start-up")
    steps_per_rollout: int = option(1, ge=1, help="optimizer steps per rollout step")
    lr: float = option(1e-6, gt=0.0, help="peak learning rate (after warm-up)")
    kl_loss_coef: float = option(0.0, ge=0.0, help="weight of the KL(policy || reference) loss term")
    kl_kind: Literal["k1", "k2", "k3", "abs", "k1+", "k3+"] = option(
        "k3", help="KL estimator of the loss term and the reward penalty (posttrain.core.losses.kl_divergence)")
    kl_in_reward_coef: float = option(0.0, ge=0.0, help="per-token reward penalty -coef * KL_t (classic RLHF "
                                                        "shaping), added to the estimator's token_rewards")
    log_kl: bool = option(False, help="log train/kl to the reference even when no KL term uses it: costs one "
                                      "forward pass of the reference per step and a copy of the initial weights "
                                      "(without it and without KL terms, neither)")
    old_log_probs_from_train: bool = option(
        True, help="when a batch is trained in one optimizer step (steps_per_rollout 1) and nothing needs the "
                   "old policy's log-probs before it (no correction, kl_in_reward_coef 0, an estimator without "
                   "needs.log_probs), take them from the training forward instead of a separate pass")
    entropy_coef: float = option(0.0, help="weight of the entropy bonus")
    grad_clip: float = option(1.0, ge=0.0, help="max global grad norm; 0 disables")
    weight_decay: float = option(0.0, ge=0.0, help="AdamW decoupled weight decay")
    adam_beta1: float = option(0.9, ge=0.0, lt=1.0, help="Adam first-moment decay")
    adam_beta2: float = option(0.98, ge=0.0, lt=1.0, help="Adam second-moment decay")
    adam_eps: float = option(1e-8, gt=0.0, help="Adam denominator epsilon")
    lr_warmup_steps: int = option(0, ge=0, help="linear warm-up from 0 over this many optimizer steps")
    lr_decay_style: Literal["constant", "linear", "cosine"] = option("constant", help="after warm-up")
    lr_decay_steps: int | None = option(None, ge=1, help="steps from start to min_lr (linear/cosine)")
    min_lr: float = option(0.0, ge=0.0, help="the learning rate at the end of the decay")
    value_clip: float = option(0.2, ge=0.0, help="critic value clipping range; 0 disables")
    peak_tflops: float | None = option(None, gt=0.0, help="peak TFLOP/s of one trainer device for perf/mfu; "
                                                          "default: a table by GPU name (none on CPU: no perf/mfu)")
    deterministic: bool | None = option(None, help="deterministic CUDA kernels, so a seeded GPU run repeats (slower "
                                                    "attention backward); None: on with rollout.seed_sampling")
    backend: Any = component("trainers", default=True, help="the trainer backend and its options: "
                             "{name: megatron, tp: 2}; see `rl-cli plugins list --kind trainer`")
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters instead of full fine-tuning

    @property
    def uses_reference(self) -> bool:
        """Whether the run computes the reference policy's log-probs: a KL loss term, the KL reward penalty or
        ``log_kl``. Without, no reference pass runs and trainer backends keep no copy of the initial weights."""
        return self.kl_loss_coef > 0 or self.kl_in_reward_coef > 0 or self.log_kl

    def validate(self) -> list[str]:
        errors = []
        if self.global_batch_size % self.micro_batch_size:
            errors.append(f"micro_batch_size: {self.micro_batch_size} does not divide global_batch_size "
                          f"{self.global_batch_size}")
        if self.lr_decay_style != "constant" and self.lr_decay_steps is None:
            errors.append(f"lr_decay_steps: required with lr_decay_style {self.lr_decay_style!r}")
        return errors


@dataclass
class ResourcesConfig:
    """Where the roles run (slime's resource flags)."""

    executor: Literal["local", "ray"] = option("local", help="local processes, or Ray actors")
    ray_address: str | None = option(None, help="an existing Ray cluster; default starts a local one")
    trainer_nodes: int = option(1, ge=1, help="nodes of the trainer group (more than 1 needs executor: ray)")
    trainer_gpus_per_node: int = option(
        0, ge=0, help="GPUs of the trainer (it trains on CUDA whenever CUDA is there); engines on `cuda` start "
                      "after them unless colocated")
    trainer_procs_per_node: int | None = option(
        None, ge=1, help="trainer ranks per node (one process each); default: trainer_gpus_per_node on GPUs, 1 "
                         "on CPU. World size = trainer_nodes x this; DP = world / (TP x PP x CP)")
    rollout_gpus: int = option(0, ge=0, help="GPUs of the engines (0: engines on the CPU, or on the trainer's GPUs when colocated)")
    gpus_per_engine: int = option(1, ge=1, help="GPUs per engine server (its tensor parallelism)")
    num_engines: int = option(1, ge=1, help="engine servers behind the router")
    colocate: bool = option(False, help="trainer and engines share GPUs (engine memory released while training)")
    offload_trainer: bool = option(
        False, help="colocated: the trainer's weights, optimizer state and reference weights wait in pinned host "
                    "memory while the engines generate, its gradients freed (room for larger models and KV "
                    "caches; a copy each way per step)")

    @property
    def procs_per_node(self) -> int:
        """Trainer ranks per node, the default resolved."""
        return self.trainer_procs_per_node or max(1, self.trainer_gpus_per_node)

    @property
    def trainer_world_size(self) -> int:
        """Ranks of the trainer group: ``trainer_nodes x procs_per_node``."""
        return self.trainer_nodes * self.procs_per_node

    def validate(self) -> list[str]:
        errors = []
        if self.trainer_nodes > 1 and self.executor != "ray":
            errors.append(f"trainer_nodes: {self.trainer_nodes} nodes need resources.executor: ray "
                          f"(the local executor runs on this machine only)")
        if self.trainer_gpus_per_node and self.procs_per_node > self.trainer_gpus_per_node:
            errors.append(f"trainer_procs_per_node: {self.procs_per_node} ranks per node but "
                          f"trainer_gpus_per_node is {self.trainer_gpus_per_node} (one rank per GPU)")
        return errors


@dataclass
class LoggingConfig:
    interval: int = option(1, ge=1, help="steps between progress lines (metrics.jsonl gets every step)")
    tensorboard: bool = option(True, help="write TensorBoard events to RUN_DIR/tensorboard")
    wandb: bool = option(False, help="log to Weights & Biases (pip install wandb; offline with WANDB_MODE=offline)")
    wandb_project: str | None = option(None, help="the W&B project (default: W&B's)")


@dataclass
class CheckpointConfig:
    interval: int = option(0, ge=0, help="steps between checkpoints; 0 disables")
    keep: int = option(2, ge=1, help="checkpoints kept")
    hf_init_weights: bool = option(
        False, help="also write the initial policy's weights to RUN_DIR/hf-init (a copy of the model on disk, written "
                    "at start; the engines then load them). Off: hf-init holds config.json and the tokenizer, and "
                    "the engines take their weights from the first push")
    on_stop: bool = option(
        True, help="Ctrl-C or SIGTERM while training: finish the step in flight, save a checkpoint at its end and "
                   "stop with the command that resumes it (a second signal stops at once, losing the step)")
    stop_timeout_s: float = option(
        120.0, ge=0.0, help="with on_stop: the longest the step in flight may take to end before the run stops "
                            "without its checkpoint (0: no bound; Slurm sends SIGKILL some seconds after SIGTERM)")


@dataclass
class EvalDataset:
    """One eval set: prompts read like ``data`` (same keys), sampled with its own settings."""

    name: str = field(metadata={"help": "logged as eval/<name>/..."})
    path: str = field(metadata={"help": "the eval prompts (formats as data.path)"})
    input_key: str = option("prompt", help="key holding the prompt")
    label_key: str = option("label", help="key holding the reference answer")
    metadata_key: str = option("metadata", help="key holding per-sample metadata")
    apply_chat_template: bool = option(False, help="render prompts with the chat template, as data.apply_chat_template")
    system_prompt: str | None = option(None, help="default: data.system_prompt")
    n_samples_per_prompt: int = option(1, ge=1, help="samples per prompt (the metrics average over them)")
    temperature: float = option(0.0, ge=0.0, help="0: greedy")
    top_p: float = option(1.0, gt=0.0, le=1.0, help="nucleus sampling")
    max_new_tokens: int | None = option(None, ge=1, help="default: rollout.max_new_tokens")
    limit: int | None = option(None, ge=1, help="evaluate the first N prompts only")

    def validate(self) -> list[str]:
        return sampling_errors(self.temperature, "temperature")


def sampling_errors(temperature: float, key: str) -> list[str]:
    """A temperature an engine can sample at: 0 (greedy) or at least ``1e-5`` (``logits / 1e-300``
    overflows to inf and the softmax to NaN, which crashes a decode step)."""
    if 0.0 < temperature < 1e-5:
        return [f"{key}: {temperature!r} is out of range (0 for greedy, else >= 1e-05)"]
    return []


@dataclass
class EvalConfig:
    interval: int = option(0, ge=0, help="steps between evals; 0 disables")
    datasets: list[EvalDataset] = option(default_factory=list, help="eval sets, logged as eval/<name>/...")


@dataclass
class TeacherConfig:
    """A teacher for on-policy distillation (estimators whose ``needs.teacher`` is set): a second engine fleet that
    scores the student's samples (``posttrain.core.rollout.teacher``). Its tokenizer must be the student's."""

    path: str | None = option(None, help="HF checkpoint the teacher engines serve (not needed for external URLs)")
    engine: Any = component("engines", default=True, help="the teacher's engine backend: {name: local, device: "
                            "cuda:1}, or {name: external, urls: [...]} for running servers")
    num_engines: int = option(1, ge=1, help="teacher engines (behind their own router)")
    use_router: bool = option(True, help="route the teacher's /generate through its own sglang-router")
    server_concurrency: int = option(512, ge=1, help="teacher requests in flight")
    tokenizer: str | None = option(None, help="the teacher's tokenizer directory (default: path; external "
                                              "engines: the tokenizer_path their /get_model_info reports)")


@dataclass
class RunConfig:
    """The whole run. Component sections hold a :class:`Selection`; the others plain dataclasses."""

    seed: int = option(0, help="seeds the trainer's init, the data order and (rollout.seed_sampling) sampling")
    mode: Any = component("modes", default=True, help="what the run does: the RL loop (the default), supervised "
                          "fine-tuning, ...; see `rl-cli plugins list --kind mode`")
    model: Any = component("models", optional=True, help="model spec and checkpoint")
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generator: Any = component("generators", optional=True, help="turns prompt groups into samples")
    estimator: Any = component("estimators", optional=True, help="advantage estimator (the mode says whether "
                               "it is required)")
    loss: Any = component("losses", optional=True, help="policy loss")
    correction: Any = component("corrections", optional=True, help="rollout/training mismatch correction")
    rewards: Any = component("rewards", many=True, help="weighted reward functions")
    reward_runner: RewardRunnerConfig = field(default_factory=RewardRunnerConfig)
    filters: Any = component("filters", many=True, help="dynamic-sampling filters")
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    teacher: TeacherConfig | None = option(None, help="a teacher fleet for on-policy distillation")
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)

    def validate(self) -> list[str]:
        mode = self.mode.cls
        errors = [f"{key}: required key is missing" for key in mode.required if getattr(self, key) is None]
        errors += self._teacher_errors()
        if mode.generates:
            errors += batch_identity(self.rollout, self.trainer)
        r, colocate = self.rollout, self.resources.colocate
        if colocate and r.mode in ("async", "fully_async"):
            errors.append(f"rollout.mode: {r.mode} overlaps generation with training, which needs their own GPUs "
                          "(resources.colocate: false)")
        if self.resources.offload_trainer and not colocate:
            errors.append("resources.offload_trainer: only colocated runs offload the trainer (resources.colocate: "
                          "true); on GPUs of its own it keeps its state")
        if self.resources.offload_trainer and not getattr(self.trainer.backend.cls, "offloads", False):
            errors.append(f"resources.offload_trainer: trainer backend {self.trainer.backend.name!r} cannot offload "
                          f"its models (its class does not set offloads = True)")
        engine = r.engine.create() if r.engine is not None else None
        if colocate and r.weight_sync == "distributed" and engine is not None and engine.on_gpu(self.resources):
            errors.append("rollout.weight_sync: distributed (NCCL) cannot join two processes on one GPU; "
                          "colocated engines take tensor (or disk, or auto)")
        if engine is not None and r.weight_sync != "auto" and r.weight_sync not in engine.weight_sync_modes:
            errors.append(f"rollout.weight_sync: engine backend {r.engine.name!r} supports "
                          f"{', '.join(engine.weight_sync_modes)}, not {r.weight_sync}")
        shared = gpus_shared_with_trainer(engine, self.resources) if engine is not None else []
        if not colocate and shared and r.weight_sync == "distributed":
            errors.append(f"rollout.weight_sync: distributed (NCCL) cannot join two processes on one GPU, and the "
                          f"trainer and an engine share cuda:{shared[0]}; use tensor (CUDA IPC), disk or auto, or "
                          f"put the engines on other GPUs (resources.trainer_gpus_per_node, rollout.engine)")
        return errors

    def weight_sync_mode(self) -> str:
        """``rollout.weight_sync`` resolved for this run's placement (see :meth:`RolloutConfig.weight_sync_mode`)."""
        engine = self.rollout.engine.create()
        shared = gpus_shared_with_trainer(engine, self.resources)
        return self.rollout.weight_sync_mode(self.resources.colocate, shared, engine.on_gpu(self.resources))

    def components(self) -> list[Selection]:
        """Every selected component, the backends inside ``rollout`` and ``trainer`` included."""
        out = [self.rollout.engine, self.trainer.backend]
        for value in vars(self).values():
            out += value if isinstance(value, list) else [value]
        return [c for c in out if isinstance(c, Selection)]

    def component_errors(self, plugins: Any) -> list[str]:
        """What selected components find wrong with this run: those whose class defines
        ``check_config(run, plugins) -> ["key: reason", ...]`` (backends, generators with tools) are asked."""
        errors = [e for c in self.components() if callable(getattr(c.cls, "check_config", None))
                  for e in c.cls(c.config).check_config(self, plugins)]
        if self.teacher is not None:  # the engine backend's checks, under the teacher's key
            errors += [e.replace("rollout.engine", "teacher.engine", 1)
                       for e in self.teacher.engine.create(plugins).check_config(self, plugins)
                       if e.startswith("rollout.engine")]
        return errors + exact_errors(self, plugins)

    def _teacher_errors(self) -> list[str]:
        wants = self.estimator is not None and needs_of(self.estimator.cls).teacher
        if wants and self.teacher is None:
            return [f"teacher: required by estimator {self.estimator.name!r} (a teacher: section with its "
                    f"checkpoint path, or engine: {{name: external, urls: [...]}})"]
        if self.teacher is not None and not wants:
            return ["teacher: set, but the estimator does not use one (estimators with needs.teacher do)"]
        if self.teacher is not None and self.teacher.path is None and self.teacher.engine.create().urls() is None:
            return ["teacher.path: required: the checkpoint the teacher engines serve"]
        return []


    def missing_for_training(self) -> list[str]:
        """Sections a config may leave out while it is validated piecemeal, but a run needs."""
        kinds = {f.name: f.metadata.get("component") for f in fields(self)}
        return [f"{key}: required to train (see `rl-cli plugins list --kind {KINDS[kinds[key]]}`)"
                for key in self.mode.cls.needed_to_train if getattr(self, key) is None]

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML-able), with components flattened back to ``{name, ...config}``."""
        return {key: to_dict(value) for key, value in vars(self).items()}


def gpus_shared_with_trainer(engine: Any, res: ResourcesConfig) -> list[int]:
    """GPU indices that the engines of backend ``engine`` share with the trainer, without colocation. The
    trainer takes GPUs ``0 .. trainer_gpus_per_node - 1`` (the local executor trains on GPU 0 even when that
    is 0, whenever CUDA is there; a Ray actor with no GPUs trains on the CPU); the engines take
    ``engine.engine_gpus(res)``."""
    if res.colocate:
        return []
    trainer = res.trainer_gpus_per_node if res.executor == "ray" else max(1, res.trainer_gpus_per_node)
    return sorted({g for g in engine.engine_gpus(res) if g < trainer})


def batch_identity(r: RolloutConfig, t: TrainerConfig) -> list[str]:
    """``rollout_batch_size x n_samples_per_prompt == global_batch_size x steps_per_rollout``: every
    generated sample is trained on exactly once per rollout step."""
    if r.rollout_batch_size * r.n_samples_per_prompt == t.global_batch_size * t.steps_per_rollout:
        return []
    return [f"trainer.global_batch_size: batch identity violated: rollout.rollout_batch_size "
            f"({r.rollout_batch_size}) x rollout.n_samples_per_prompt ({r.n_samples_per_prompt}) = "
            f"{r.rollout_batch_size * r.n_samples_per_prompt} != trainer.global_batch_size "
            f"({t.global_batch_size}) x trainer.steps_per_rollout ({t.steps_per_rollout}) = "
            f"{t.global_batch_size * t.steps_per_rollout}"]


def _fully_async_correction(raw: Any, plugins: Any) -> None:
    """A ``fully_async`` run that names no ``correction`` gets the one registered with
    ``fully_async_default = True`` (``tis``): its off-policy tokens are reweighted against the rollout
    log-probs. ``correction: null`` keeps none."""
    if not (isinstance(raw, dict) and isinstance(raw.get("rollout"), dict)
            and raw["rollout"].get("mode") == "fully_async" and "correction" not in raw):
        return
    registry = plugins.registries().get("corrections", {})
    marked = [n for n in registry if getattr(registry.get_or_raise(n), "fully_async_default", False)]
    if marked:
        raw["correction"] = marked[0]


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = (), plugins: Any = None,
                data: dict | None = None) -> RunConfig:
    """Read ``path`` (or take ``data``), apply ``key.sub=value`` overrides, validate against the plugins.

    :raises ConfigError: with every problem found (unknown keys and names, wrong types, bounds,
        missing files, the batch identity), each prefixed with its dotted path.
    """
    if plugins is None:
        from posttrain.core.plugins import load_plugins

        plugins = load_plugins()
    source = str(path) if path is not None else "config"
    raw = copy.deepcopy(data) if data is not None else read_yaml(path)
    errors = apply_overrides(raw, overrides)
    errors += moved_keys(raw)
    errors += resolve_files(raw, Path(path).parent if path else Path("."))
    _fully_async_correction(raw, plugins)
    config, errs = build(RunConfig, raw, "", context=plugins)
    errors += errs
    if config is not None:
        errors += config.component_errors(plugins)
    elif isinstance(raw, dict) and mode_generates(raw, plugins):  # still report the batch identity if its
        rollout, e1 = build(RolloutConfig, raw.get("rollout"), "rollout", context=plugins)  # sections are valid
        trainer, e2 = build(TrainerConfig, raw.get("trainer"), "trainer", context=plugins)
        if not (e1 or e2):
            errors += batch_identity(rollout, trainer)
    if errors:
        raise ConfigError(_plugin_file_hints(errors, path), _source_named(source, errors, overrides))
    return config


_UNKNOWN_NAME = re.compile(r": unknown [a-z_ ]+ '([^']+)'")


def _plugin_file_hints(errors: list[str], path: str | Path | None) -> list[str]:
    """An unknown component name that a ``.py`` file beside the config defines: the error says to pass that file
    with ``--plugin`` (the examples that bring their own plugins are run so)."""
    if path is None:
        return errors
    files = sorted(Path(path).parent.glob("*.py"))
    out = []
    for error in errors:
        found = _UNKNOWN_NAME.search(error)
        name = found.group(1) if found else None
        where = next((f for f in files if name and re.search(rf"""name\s*=\s*["']{re.escape(name)}["']""",
                                                              f.read_text(errors="replace"))), None)
        out.append(f"{error} {where} defines it: add `--plugin {where}`" if where else error)
    return out


def _source_named(source: str, errors: list[str], overrides: list[str] | tuple[str, ...]) -> str:
    """``source``, and the command-line overrides the errors are about, so none is sought in the file."""
    from posttrain.core.config_source import split_setting

    paths = [e.split(":", 1)[0] for e in errors]
    named = [item for item in overrides if (s := split_setting(item)) is not None
             and any(p == s[0] or p.startswith(s[0] + ".") for p in paths)]
    return f"{source} with the command line's {', '.join(named)}" if named else source


def mode_generates(raw: dict[str, Any], plugins: Any) -> bool:
    """Whether the (possibly invalid) config's mode generates with engines (True when it is invalid too)."""
    parse = next(f for f in fields(RunConfig) if f.name == "mode").metadata["parse"]
    mode, errors = parse(raw.get("mode", {}), "mode", plugins)
    return errors != [] or mode is None or mode.cls.generates
