"""LoRA on the fsdp2 trainer (peft): only adapters train, the push carries adapters only and both engines merge
them, checkpoints hold the adapters and resume exactly, hf-final holds the merged model and a peft adapter."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.lora import LORA_A, LORA_B


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny qwen3 checkpoint, an fsdp2 model with rank-4 adapters after two steps, and the objects that built it."""
    from posttrain.core.plugins import load_plugins
    from posttrain.testing.contracts.trainer import contract_batch, run_config
    from posttrain.testing.tiny import make_tiny_checkpoint

    torch.set_num_threads(1)
    hf = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "qwen3")
    plugins = load_plugins(autoload=False)
    cls = plugins.registry("trainers")["fsdp2"]
    backend = cls(cls.Config())
    run = run_config(backend, lr=2e-2, lr_warmup_steps=0, kl_loss_coef=0.1)
    run.trainer.lora.rank, run.trainer.lora.alpha = 4, 8.0
    run.model.config.path = str(hf)
    model = backend.build(run.model.create(plugins), run)
    base = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    batch = contract_batch()
    batch.old_log_probs = model.log_probs(batch)[0]
    batch.ref_log_probs = model.log_probs(batch, weights="ref")[0]
    loss = run.loss.create(plugins)
    for _ in range(2):
        model.train_step(batch, loss)
    return {"model": model, "base": base, "batch": batch, "loss": loss, "run": run, "backend": backend,
            "plugins": plugins, "hf": hf}


def test_only_the_adapters_train(trained):
    model, base = trained["model"], trained["base"]
    named = dict(model.model.named_parameters())
    adapters = {n for n in named if ".lora_" in n}
    assert adapters and {n for n, p in named.items() if p.grad is not None} == adapters
    assert {id(p) for p in model.optimizer.state} == {id(named[n]) for n in adapters}
    assert all(torch.equal(named[n].detach(), base[n]) for n in named if n not in adapters), "the base is frozen"
    assert any(not torch.equal(named[n].detach(), base[n]) for n in adapters if "lora_B" in n), "B moved from 0"
    ref = model.log_probs(trained["batch"], weights="ref")[0]
    assert torch.allclose(ref, trained["batch"].ref_log_probs, atol=1e-6), "the reference is the base model"


def test_push_is_adapters_only_and_engines_merge_it(trained):
    """A first push (base + adapters) then an adapter-only one into the local engine and the hf engine, both built
    from config.json alone: each then holds the merged weights export_hf gives, twice in a row (merged from the
    base, not on top of the last merge), and the local engine's logits are the merged HF model's."""
    from posttrain.plugins.engines.hf.generator import HFGenerator
    from posttrain.plugins.engines.local.model_runner import ModelRunner

    model = trained["model"]
    merged = {n: t.clone() for b in model.export_hf() for n, t in b}
    adapters = [(n, t) for b in model.export_update(1 << 30, full=False) for n, t in b]
    assert adapters and all(n.endswith((LORA_A, LORA_B)) for n, _ in adapters)
    full_bytes = sum(t.numel() * t.element_size() for t in merged.values())
    assert sum(t.numel() * t.element_size() for _, t in adapters) < 0.1 * full_bytes
    local = ModelRunner(trained["hf"], max_slots=2, context_length=32, from_config=True)
    hf = HFGenerator(str(trained["hf"]), from_config=True)
    for engine, weights in ((local, local.named_weights), (hf, hf.own_tensors)):
        for bucket in model.export_update(1 << 30, full=True):
            engine.load_weights(dict(bucket))
        for _ in range(2):
            engine.load_weights(dict(adapters))
            held = weights()
            assert all(torch.allclose(held[n], t, atol=1e-6) for n, t in merged.items()), type(engine).__name__
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(trained["hf"], dtype=torch.float32)
    reference.load_state_dict(merged, strict=False)
    prompt = trained["batch"].tokens[0, :7].tolist()
    want = reference(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(local.prefill([0], [prompt])[0], want, atol=1e-4)


def test_hf_final_is_the_merged_model_and_a_peft_adapter(trained, tmp_path):
    import peft
    import transformers

    model = trained["model"]
    out = model.save_hf(tmp_path / "hf-final")
    tokens = trained["batch"].tokens[:1]
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(trained["hf"], dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out / "adapter")
    with torch.no_grad():
        a, b = merged(tokens).logits, adapted(tokens).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(trained["hf"], dtype=torch.float32)(tokens).logits
    assert torch.allclose(a, b, atol=1e-5) and (a - plain).abs().max() > 1e-4, "the adapter is in both, not zero"


def test_checkpoint_holds_the_adapters_and_resumes_exactly(trained, tmp_path):
    model, run, backend = trained["model"], trained["run"], trained["backend"]
    model.save(tmp_path / "ckpt")
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    assert any(".lora_A." in k for k in keys) and not any("base_layer" in k for k in keys), "adapters only"
    other = backend.build(run.model.create(trained["plugins"]), run)
    other.load(tmp_path / "ckpt")
    batch = trained["batch"]
    after = [m.train_step(batch, trained["loss"]) for m in (model, other)]
    assert after[0] == after[1]
    assert all(torch.equal(p, q) for p, q in zip(model.model.parameters(), other.model.parameters()))


def test_the_trainer_role_pushes_adapters_only_to_engines_that_merge_them(trained):
    """TrainerRole's push: base + adapters, then adapters, to the local engine; merged weights to an engine backend
    without ``merges_adapters`` (SGLang's), every push."""
    from types import SimpleNamespace

    from posttrain.core.actors.trainer import TrainerRole
    from posttrain.core.plugins import load_plugins

    engines = load_plugins(autoload=False).registry("engines")
    model = trained["model"]
    names = {}
    for engine in ("local", "sglang"):
        role = SimpleNamespace(policy=model, engine_backend=engines[engine], full_push_due=True)
        names[engine] = [[n for b in TrainerRole._update_buckets(role, 1 << 30) for n, _ in b]]
        role.full_push_due = False
        names[engine].append([n for b in TrainerRole._update_buckets(role, 1 << 30) for n, _ in b])
    merged = [n for b in model.export_hf() for n, _ in b]
    assert names["sglang"] == [merged, merged]
    first, then = names["local"]
    assert set(merged) < set(first) and then == [n for n in first if n not in merged]
