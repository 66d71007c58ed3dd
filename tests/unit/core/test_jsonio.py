"""``core.jsonio``: the hot path's JSON (orjson when installed) gives back what the standard library does."""

import json

from posttrain.core import jsonio


def test_dumps_finite_writes_what_json_reads_back_big_ints_included():
    body = {"input_ids": [[1, 2], [3]], "sampling_params": [{"sampling_seed": -(2**63)}, {"sampling_seed": 2**70}],
            "return_logprob": True, "t": 0.1}
    assert json.loads(jsonio.dumps_finite(body)) == body  # 2**70: orjson refuses it, json writes it


def test_finite_finds_a_nan_or_infinity_anywhere():
    assert jsonio.finite({"a": [1, 2.5, {"b": (0.0, -1e300)}], "c": "nan", "d": None})
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not jsonio.finite({"a": [{"b": [1, bad]}]})
    assert not jsonio.finite(float("nan")) and jsonio.finite(3)
