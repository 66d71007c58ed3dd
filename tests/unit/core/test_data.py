"""Prompt data: formats, slicing, keys, chat templates, max_prompt_len, and file:line errors."""

import json

import pytest

from posttrain.core.config import DataConfig
from posttrain.core.data import DataError, check_data, load_prompts, split_slice

ROWS = [{"prompt": f"What is {i}+{i}?", "label": str(2 * i), "metadata": {"i": i}} for i in range(6)]


def cfg(path, **kw):
    return DataConfig(path=str(path), **kw)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from posttrain.testing.tiny import make_tokenizer

    return make_tokenizer()


def test_formats_agree(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.json").write_text(json.dumps(ROWS, indent=2))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    loaded = [load_prompts(cfg(p)) for p in (jsonl, tmp_path / "d.json", tmp_path / "d.parquet",
                                              tmp_path / "saved", tmp_path / "dd")]
    for ds in loaded:
        assert [(r.prompt, r.label, r.metadata) for r in ds.rows] == \
            [(r["prompt"], r["label"], r["metadata"]) for r in ROWS]
    assert loaded[0].rows[2].source == f"{jsonl}:3"
    assert loaded[1].rows[1].source.endswith("d.json:9")  # "[" on line 1, then 7 lines per object
    assert loaded[2].rows[0].source.endswith("d.parquet:row 1")


def test_slicing_and_keys(tmp_path):
    rows = [{"question": f"q{i}", "answer": i, "extra": {"k": i}, "fns": json.dumps([{"name": "f"}])}
            for i in range(10)]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    c = cfg(f"{p}@[2:5]", input_key="question", label_key="answer", metadata_key="extra", tools_key="fns")
    ds = load_prompts(c)
    assert [r.prompt for r in ds.rows] == ["q2", "q3", "q4"]
    assert ds.rows[0].label == 2 and ds.rows[0].metadata == {"k": 2, "tools": [{"name": "f"}]}
    assert [r.prompt for r in load_prompts(cfg(f"{p}@[-2:]", input_key="question")).rows] == ["q8", "q9"]
    assert split_slice("a@[:3]") == ("a", slice(None, 3)) and split_slice("a.jsonl") == ("a.jsonl", None)
    with pytest.raises(DataError, match=r"empty \(slice \[20:30\]\)"):
        load_prompts(cfg(f"{p}@[20:30]", input_key="question"))


def test_chat_template_and_max_prompt_len(tmp_path, tokenizer):
    rows = [{"prompt": "hi"}, {"prompt": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hello"}]},
            {"prompt": "x" * 200}]
    p = write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_prompts(cfg(p, apply_chat_template=True), tokenizer)
    assert ds.rows[0].prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ds.rows[1].prompt.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello")
    short = load_prompts(cfg(p, apply_chat_template=True, max_prompt_len=100), tokenizer)
    assert len(short) == 2 and short.filtered == 1 and "1 longer than max_prompt_len" in short.summary()
    raw = load_prompts(cfg(p, max_prompt_len=100), tokenizer)  # messages kept as messages, still measured
    assert isinstance(raw.rows[1].prompt, list) and raw.filtered == 1
    with pytest.raises(DataError, match="need the model's tokenizer"):
        load_prompts(cfg(p, apply_chat_template=True))


def test_template_kwargs_and_tools_reach_the_template(tmp_path, tokenizer):
    tok = tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% if tools %}TOOLS={{ tools | length }};{% endif %}{% if flag %}FLAG;{% endif %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    try:
        p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "go", "tools": [{"name": "a"}, {"name": "b"}]}])
        ds = load_prompts(cfg(p, apply_chat_template=True, chat_template_kwargs={"flag": True}), tok)
        assert ds.rows[0].prompt == "TOOLS=2;FLAG;go"
    finally:
        tok.chat_template = saved


def test_every_bad_row_is_reported_with_its_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b'{"prompt": "ok", "label": "1"}\n'
                  b'{"prompt": "broken",\n'
                  b'{"question": "no prompt key"}\n'
                  b'{"prompt": 42}\n'
                  b'\n'
                  b'{"prompt": "caf\xe9"}\n'
                  b'[1, 2]\n'
                  b'{"prompt": "m", "metadata": [1]}\n'
                  b'{"prompt": "fine"}\n')
    with pytest.raises(DataError) as info:
        load_prompts(cfg(p))
    errors = info.value.errors
    assert len(errors) == 6
    assert errors[0].startswith(f"{p}:2: invalid JSON")
    assert errors[1].startswith(f"{p}:3: missing key 'prompt' (data.input_key); the row has: question")
    assert errors[2].startswith(f"{p}:4: 'prompt' must be a string or a non-empty list of chat messages")
    assert errors[3].startswith(f"{p}:6: not UTF-8 text")
    assert errors[4].startswith(f"{p}:7: expected a JSON object")
    assert errors[5].startswith(f"{p}:8: 'metadata' must be a mapping")
    skipped = load_prompts(cfg(p, on_bad_row="skip"))
    assert [r.prompt for r in skipped.rows] == ["ok", "fine"] and skipped.skipped == 6
    assert check_data(cfg(p)) == errors


def test_file_level_problems(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert check_data(cfg(tmp_path / "empty.jsonl")) == [f"{tmp_path / 'empty.jsonl'}: the dataset is empty"]
    (tmp_path / "x.csv").write_text("a,b")
    assert "unsupported format '.csv'" in check_data(cfg(tmp_path / "x.csv"))[0]
    assert check_data(cfg(tmp_path / "nope.jsonl")) == ["data.path: no such file or directory: " +
                                                        str(tmp_path / "nope.jsonl")]
    (tmp_path / "bad.json").write_text('[\n{"prompt": "a"},\n{"prompt": }\n]')
    assert check_data(cfg(tmp_path / "bad.json"))[0].startswith(f"{tmp_path / 'bad.json'}:3: invalid JSON")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    assert "not a readable parquet file" in check_data(cfg(tmp_path / "bad.parquet"))[0]


def test_json_must_be_a_list(tmp_path):
    (tmp_path / "one.json").write_text('{"prompt": [{"role": "user", "content": "hi"}]}')
    assert "expected a JSON list of objects" in check_data(cfg(tmp_path / "one.json"))[0]
    (tmp_path / "msgs.json").write_text('[{"prompt": [{"role": "user", "content": "hi"}], "label": 1}]')
    assert load_prompts(cfg(tmp_path / "msgs.json")).rows[0].prompt == [{"role": "user", "content": "hi"}]


def test_messages_with_tool_calls_and_bad_messages(tmp_path):
    good = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w", "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny"}]
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": good}, {"prompt": [{"role": "user"}]}, {"prompt": []}])
    errors = check_data(cfg(p))
    assert [e.split(": ")[0] for e in errors] == [f"{p}:2", f"{p}:3"]
    assert load_prompts(cfg(p, on_bad_row="skip")).rows[0].prompt == good


def test_system_prompt_goes_before_each_prompt(tmp_path, tokenizer):
    chat = [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]
    p = write_jsonl(tmp_path / "d.jsonl", [ROWS[0], {"prompt": chat, "label": "x"}])
    plain, own = load_prompts(cfg(p, system_prompt="Think.")).rows  # the generator renders messages
    assert plain.prompt == [{"role": "system", "content": "Think."}, {"role": "user", "content": "What is 0+0?"}]
    assert own.prompt == chat, "a conversation's own system message is kept"
    rendered = load_prompts(cfg(p, system_prompt="Think.", apply_chat_template=True), tokenizer).rows[0].prompt
    assert rendered == ("<|im_start|>system\nThink.<|im_end|>\n<|im_start|>user\nWhat is 0+0?<|im_end|>\n"
                        "<|im_start|>assistant\n")
