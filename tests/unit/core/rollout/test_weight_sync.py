"""Weight updates: over a Gloo group from this process (WeightSender) and from disk; weight_version advances;
updates are all or nothing, directories must cover the model, and only key holders may update."""

from __future__ import annotations

import pytest

from posttrain.core.rollout.client import EngineClient
from posttrain.core.rollout.weight_sync import WeightSender
from posttrain.testing.engine import hf_greedy, start_local_engine as start_engine

PROMPT = [5, 6, 7, 8]
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture
def own_engine(tiny_ckpt, tmp_path):
    server = start_engine(tiny_ckpt, str(tmp_path))
    yield server
    server.stop()


def _load(path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.slow
async def test_gloo_update_gives_the_new_weights_output_then_disk_restores(own_engine, tiny_ckpt, tiny_ckpt_b, hf_model):
    import asyncio

    new_model = _load(tiny_ckpt_b)
    old_out, new_out = hf_greedy(hf_model, PROMPT, 10), hf_greedy(new_model, PROMPT, 10)
    assert old_out != new_out  # else the test could not tell the weights apart
    async with EngineClient(own_engine.base_url, api_key=own_engine.api_key) as engine:
        before = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert before["output_ids"] == old_out

        sender = WeightSender([own_engine.base_url], backend="gloo", api_key=own_engine.api_key)
        await asyncio.to_thread(sender.init)
        named = list(new_model.state_dict().items())
        buckets = [named[i:i + 7] for i in range(0, len(named), 7)]  # several buckets, several calls
        await asyncio.to_thread(sender.send, buckets, 5)
        after = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert after["output_ids"] == new_out
        assert after["meta_info"]["weight_version"] == "5"

        await asyncio.to_thread(sender.update_from_disk, str(tiny_ckpt), 6)
        restored = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert restored["output_ids"] == old_out and restored["meta_info"]["weight_version"] == "6"
        await asyncio.to_thread(sender.update_from_tensors, list(new_model.state_dict().items()), "7")
        again = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert again["output_ids"] == new_out and again["meta_info"]["weight_version"] == "7"
        await asyncio.to_thread(sender.destroy)


@pytest.mark.slow
async def test_a_flat_bucket_push_lands_every_tensor_bit_for_bit(own_engine, tiny_ckpt_b):
    """``flat=True``: each bucket is one uint8 broadcast (mixed dtypes, odd sizes, a 0-dim tensor's
    neighbours); the engine's checksums then equal the new weights' own."""
    import asyncio
    import hashlib

    import torch

    from posttrain.core.rollout.weight_sync import flat_layout

    offsets, total = flat_layout(["float32", "bfloat16", "float32"], [[3], [5, 1], []])
    assert offsets == [0, 16, 32] and total == 48
    new_model = _load(tiny_ckpt_b)
    named = list(new_model.state_dict().items())
    sender = WeightSender([own_engine.base_url], backend="gloo", api_key=own_engine.api_key, flat=True)
    assert sender.flat
    await asyncio.to_thread(sender.init)
    await asyncio.to_thread(sender.send, [named[i:i + 5] for i in range(0, len(named), 5)], 3)
    async with EngineClient(own_engine.base_url, api_key=own_engine.api_key) as engine:
        sums = (await engine.request("GET", "/weights_checksum"))["checksums"]
    await asyncio.to_thread(sender.destroy)
    for name, t in named:
        want = hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        assert sums[name] == want, name


@pytest.mark.slow
async def test_bad_weight_updates_are_400s(own_engine, tmp_path):
    from posttrain.core.rollout.client import EngineRequestError

    async with EngineClient(own_engine.base_url, api_key=own_engine.api_key) as engine:
        with pytest.raises(EngineRequestError, match="no \\*.safetensors"):
            await engine.update_weights_from_disk(str(tmp_path))
        with pytest.raises(EngineRequestError, match="init_weights_update_group first"):
            await engine.update_weights_from_distributed(["x"], ["float32"], [[1]])
        with pytest.raises(EngineRequestError, match="serialized_named_tensors"):
            await engine.request("POST", "/update_weights_from_tensor", {"serialized_named_tensors": "x"})
        assert await engine.get_weight_version() == "0"
        out = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["meta_info"]["weight_version"] == "0"


def _save(named, directory):
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in named.items()}, str(directory / "model.safetensors"))
    return str(directory)


@pytest.mark.slow
async def test_weight_loads_are_all_or_nothing_and_cover_the_model(engine_server, tiny_ckpt_b, hf_model, tmp_path):
    """The fault probe's cases: a shape mismatch used to leave half the tensors replaced under the old
    version, and a directory with 1 of 25 tensors answered "Succeeded"."""
    import asyncio

    import torch

    from posttrain.core.rollout.client import EngineRequestError

    new = dict(_load(tiny_ckpt_b).state_dict())
    new.pop("lm_head.weight", None)  # tied: save_pretrained writes one name of it
    old_out = hf_greedy(hf_model, PROMPT, 10)
    names = sorted(new)
    own_engine = engine_server  # the session's engine: these updates must leave it as it was
    bad_shape = {**new, names[-1]: torch.zeros(3, 3)}  # sorted last: every other tensor would copy first
    async with EngineClient(own_engine.base_url, api_key=own_engine.api_key) as engine:
        before = await engine.request("GET", "/weights_checksum")
        for directory, fragment in ((_save(bad_shape, tmp_path / "shape"), "does not match the model's"),
                                    (_save({names[0]: new[names[0]]}, tmp_path / "one"), "covers 1 of")):
            with pytest.raises(EngineRequestError, match=fragment) as err:
                await engine.update_weights_from_disk(directory, "9")
            assert err.value.status == 400 and "no weight was changed" in err.value.message
        sender = WeightSender([own_engine.base_url], backend="gloo", api_key=own_engine.api_key, timeout_s=30)
        await asyncio.to_thread(sender.init)
        bucket = [(n, new[n]) for n in names[:4]] + [("model.not_a_weight", torch.zeros(2))]
        with pytest.raises(RuntimeError, match="unknown weight name 'model.not_a_weight'"):
            await asyncio.to_thread(sender.send, [bucket], 9)
        await asyncio.to_thread(sender.destroy)
        after = await engine.request("GET", "/weights_checksum")
        assert after == before  # nothing changed, not even the version
        out = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["output_ids"] == old_out


@pytest.mark.slow
async def test_only_the_key_holder_may_call_the_engine(engine_server, hf_model):
    """The pickle path (/update_weights_from_tensor) and the rest need Authorization: Bearer KEY (401
    otherwise, before the body is read); /health* answers anyone, as in SGLang."""
    import json
    import urllib.error
    import urllib.request

    from posttrain.core.rollout.weight_sync import serialize_named_tensors

    own_engine = engine_server
    url = own_engine.base_url
    evil = serialize_named_tensors([("model.norm.weight", __import__("torch").zeros(1))])
    for path, body in (("/update_weights_from_tensor", {"serialized_named_tensors": [evil]}),
                       ("/update_weights_from_disk", {"model_path": "/"}), ("/generate", {"input_ids": [1]}),
                       ("/get_server_info", {}), ("/weights_checksum", None)):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": own_engine.api_key}):
            data = json.dumps(body).encode() if body is not None else None
            req = urllib.request.Request(url + path, data=data, headers=headers)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=30)
            assert err.value.code == 401, (path, headers)
    for path in ("/health", "/health_generate"):
        with urllib.request.urlopen(url + path, timeout=30) as resp:
            assert resp.status == 200
    async with EngineClient(url, api_key=own_engine.api_key) as engine:
        out = await engine.generate(input_ids=PROMPT, sampling_params=GREEDY)
        assert out["output_ids"] == hf_greedy(hf_model, PROMPT, 10)  # the pickle never ran


@pytest.mark.slow
def test_check_weights_names_the_first_differing_tensor(engine_server, tiny_ckpt):
    """rollout.check_weights on posttrain's engine: every tensor's checksum, bit-exact in its dtype."""
    from safetensors.torch import load_file

    from posttrain.plugins.engines.local import LocalEngine

    held = sorted(load_file(str(tiny_ckpt / "model.safetensors")).items())
    check = LocalEngine().check_weights
    assert check(engine_server.base_url, engine_server.api_key, [held[:5], held[5:]]) is None
    name, tensor = held[7]
    nudged = held[:7] + [(name, tensor + 1e-6)] + held[8:]
    assert check(engine_server.base_url, engine_server.api_key, [nudged]) == \
        f"tensor {name}: its float32 bytes differ from what was pushed"
    assert "no tensor of that name" in check(engine_server.base_url, engine_server.api_key, [[("x.weight", tensor)]])


async def test_sglang_check_weights_reads_sampled_rows_back(tiny_ckpt):
    """SGLang has no checksums: ``/get_weights_by_name`` answers a parameter's first ``truncate_size`` rows as
    float32 lists (``param.cpu().to(float32).numpy().tolist()[:truncate_size]`` in its model code), here
    from a stand-in speaking that protocol, behind the key."""
    import asyncio

    from aiohttp import web
    from safetensors.torch import load_file

    from posttrain.core.rollout.procs import free_port
    from posttrain.plugins.engines.sglang import SGLangEngine

    held = dict(load_file(str(tiny_ckpt / "model.safetensors")))
    asked = []

    async def get_weights_by_name(request):
        assert request.headers["Authorization"] == "Bearer k"
        body = await request.json()
        asked.append(body["name"])
        return web.json_response(held[body["name"]].float().numpy().tolist()[:body["truncate_size"]])

    app = web.Application()
    app.router.add_post("/get_weights_by_name", get_weights_by_name)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        named = sorted(held.items())
        check = SGLangEngine().check_weights
        url = f"http://127.0.0.1:{port}"
        assert await asyncio.to_thread(check, url, "k", [named]) is None
        assert asked == [n for i, (n, _) in enumerate(named) if i % 8 == 0]
        wrong = [(n, t * 2 if i == 8 else t) for i, (n, t) in enumerate(named)]
        assert await asyncio.to_thread(check, url, "k", [wrong]) == \
            f"tensor {named[8][0]}: its first 100 rows differ from what was pushed"
    finally:
        await runner.cleanup()


def test_a_closed_group_never_closes_another_files_descriptor(tmp_path):
    """The TCP store owns rank 0's listening socket: once the group is dropped, nothing else may close that
    descriptor number again (a file opened meanwhile may hold it; CI once lost an event loop's epoll this way)."""
    import gc
    import os

    from posttrain.core.rollout.procs import free_port
    from posttrain.core.rollout.weight_sync import close_group, open_group

    for _ in range(3):  # descriptor numbers are reused lowest first: several rounds give the bug its chance
        group = open_group("gloo", "127.0.0.1", free_port(), 1, 0, timeout_s=5.0)
        close_group(group)
        files = [open(tmp_path / f"f{i}", "w") for i in range(4)]  # take the lowest free numbers
        del group
        gc.collect()
        for f in files:
            os.fstat(f.fileno())  # EBADF if the group's teardown closed a number it no longer owned
            f.close()
