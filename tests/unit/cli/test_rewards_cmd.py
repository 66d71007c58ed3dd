"""`rl-cli rewards try`: prints the score dict; bad input is a one-line UsageError."""

import json

import pytest
from typer.testing import CliRunner

from posttrain.cli.main import app
from posttrain.core.errors import UsageError

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["rewards", "try", *args])


def test_prints_the_score_dict():
    out = invoke("math", "--response", r"so \boxed{\frac12}", "--label", "0.5")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == {"score": 1.0, "format_ok": 1.0}
    out = invoke("overlong", "max_len=10", "buffer=5", "--response", "abcdefghi")
    assert json.loads(out.stdout) == {"score": pytest.approx(-0.8)}
    out = invoke("choice", "--response", "Answer: B", "--label", "green", "--metadata",
                 '{"choices": ["red", "green"]}')
    assert json.loads(out.stdout)["score"] == 1.0
    out = invoke("code", "timeout=3", "--response", "print(int(input()) * 2)",
                 "--label", '[{"input": "4", "output": "8"}]')
    assert json.loads(out.stdout)["score"] == 1.0


@pytest.mark.parametrize("args,message", [
    (("maht", "--response", "x"), "unknown reward 'maht'. Did you mean 'math'?"),
    (("math", "bogus=1", "--response", "x", "--label", "1"), "math.bogus: unknown key"),
    (("math", "timeout=-1", "--response", "x", "--label", "1"), "math.timeout: -1 is out of range"),
    (("exact_match", "--response", "x"), "reward exact_match failed on this sample: ValueError: exact_match needs"),
    (("math", "--response", "x", "--metadata", "[1]"), "--metadata: expected a JSON object"),
    (("math", "noequals", "--response", "x"), "noequals: a reward setting must look like key=value"),
])
def test_mistakes_are_usage_errors(args, message):
    out = invoke(*args)
    assert isinstance(out.exception, UsageError) and message in str(out.exception)
