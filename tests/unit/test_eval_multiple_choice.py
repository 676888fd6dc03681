"""Multiple-choice scoring: forced answers from known log-likelihoods, the model's own log-likelihood, task files."""

import json
import subprocess
import sys

import pytest
import torch

from titan_k3.eval.multiple_choice import load_task, model_loglikelihood, score_task
from titan_k3.eval.runner import load_tasks
from titan_k3.eval.tasks import Example
from titan_k3.models.k3.args import get_flavor
from titan_k3.models.k3.impl import reference_impl
from titan_k3.models.k3.model import K3Model


def encode(text: str) -> list[int]:
    return list(text.encode())


def table_loglikelihood(table: dict[str, float]):
    """A fake model: log p(choice | context) is read from `table` by the choice's text."""

    def score(context, continuations):
        assert context, "the context is passed on"
        return [table[bytes(c).decode()] for c in continuations]

    return score


def test_scores_follow_forced_loglikelihoods():
    examples = [
        Example("q1", (" yes", " no"), gold=0),       # -1 > -5: right
        Example("q2", (" yes", " no"), gold=1),       # wrong
        Example("q3", (" no", " maybe", " yes"), gold=2),  # right: " yes" is the highest
        Example("q4", (" no", " maybe"), gold=1),     # -5 < -4: right
    ]
    table = {" yes": -1.0, " no": -5.0, " maybe": -4.0}
    scores = score_task(examples, encode, table_loglikelihood(table))
    assert scores == {"acc": 0.75, "acc_norm": 0.75, "n": 4.0}


def test_acc_and_acc_norm_disagree_when_length_decides():
    # Short choice: -2 in total, -1 per character; long choice: -3 in total, -0.3 per character.
    examples = [Example("ctx", (" a", " aaaaaaaaa"), gold=1)]
    scores = score_task(examples, encode, table_loglikelihood({" a": -2.0, " aaaaaaaaa": -3.0}))
    assert scores["acc"] == 0.0 and scores["acc_norm"] == 1.0


def test_ties_go_to_the_first_choice():
    examples = [Example("ctx", (" x", " y"), gold=0), Example("ctx", (" x", " y"), gold=1)]
    scores = score_task(examples, encode, table_loglikelihood({" x": -1.0, " y": -1.0}))
    assert scores["acc"] == 0.5 and scores["acc_norm"] == 0.5


@pytest.fixture(scope="module")
def debug_model():
    torch.manual_seed(0)
    model = K3Model(get_flavor("debug", 256), reference_impl())
    model.init_weights(0)
    return model.train()


def test_model_loglikelihood_is_the_log_softmax_of_the_logits(debug_model):
    ctx, choices = [5, 17, 99, 3], [[42], [7, 8, 250], [1, 2]]
    got = model_loglikelihood(debug_model, torch.device("cpu"), max_len=64)(ctx, choices)
    assert debug_model.training, "the caller's mode is restored"
    debug_model.eval()
    with torch.no_grad():
        for cont, value in zip(choices, got):
            ids = torch.tensor(ctx + cont)
            logp = torch.log_softmax(debug_model(ids[None, :-1])[0].double(), dim=-1)
            targets = ids[len(ctx):]
            want = logp[len(ctx) - 1:].gather(1, targets[:, None]).sum().item()
            assert value == pytest.approx(want, rel=1e-5, abs=1e-5)
    debug_model.train()
    # Right padding to whole chunks changes nothing (the model is causal).
    padded = model_loglikelihood(debug_model, torch.device("cpu"), max_len=64, pad_to=16)(ctx, choices)
    assert padded == pytest.approx(got, rel=1e-5, abs=1e-5)


def test_model_loglikelihood_truncates_the_context_on_the_left(debug_model):
    ll = model_loglikelihood(debug_model, torch.device("cpu"), max_len=4)
    long_ctx = [9, 9, 9, 9, 9, 1, 2, 3]
    # 4 inputs: the row is [1, 2, 3, 4] -> targets [.., 4, 5]; the context's head is dropped.
    assert ll(long_ctx, [[4, 5]]) == pytest.approx(ll([1, 2, 3], [[4, 5]]), rel=1e-6)
    assert ll(long_ctx, [[4, 5]]) != pytest.approx(ll([9, 2, 3], [[4, 5]]), rel=1e-6)


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"context": "c", "choices": ["a", "b"], "gold": 1})


@pytest.mark.parametrize("bad, why", [
    ("{not json", "expected"),
    (json.dumps({"context": "c", "choices": ["a", "b"]}), "'gold'"),
    (json.dumps({"context": "c", "choices": "ab", "gold": 0}), "choices not a list"),
    (json.dumps({"context": "c", "choices": ["a", "b"], "gold": 2}), "gold = 2 with 2 choices"),
    (json.dumps({"context": "c", "choices": ["a"], "gold": 0}), "need >= 2 choices"),
    (json.dumps({"context": "", "choices": ["a", "b"], "gold": 0}), "empty context"),
    # str() made these the texts "None" and "2", and true the gold index 1, without a word
    (json.dumps({"context": None, "choices": ["a", "b"], "gold": 0}), "context not a string"),
    (json.dumps({"context": "c", "choices": ["a", None], "gold": 0}), "choices not a list of strings"),
    (json.dumps({"context": "c", "choices": ["a", 2], "gold": 0}), "choices not a list of strings"),
    (json.dumps({"context": "c", "choices": ["a", "b"], "gold": True}), "gold not an integer"),
])
def test_bad_task_lines_name_the_file_and_line(tmp_path, bad, why):
    path = _write(tmp_path / "t.jsonl", [GOOD, "", bad])
    with pytest.raises(ValueError) as e:
        load_task(path)
    message = str(e.value)
    assert f"'{path}' line 3" in message and why in message and "\n" not in message


BAD_FOR_BOTH = [
    ("{not json", "not JSON: Expecting property name enclosed in double quotes at column 2"),
    ("[1, 2]", "a JSON list, not an object"),
    (json.dumps({"context": "c", "choices": ["a", "b"]}), "no 'gold'"),
    (json.dumps({"context": None, "choices": ["a", "b"], "gold": 0}), "context not a string"),
    (json.dumps({"context": "c", "choices": ["a", None], "gold": 0}), "choices not a list of strings"),
    (json.dumps({"context": "c", "choices": ["a", "b"], "gold": True}), "gold not an integer"),
    (json.dumps({"context": "c", "choices": ["a", "b"], "gold": 2}), "gold = 2 with 2 choices"),
    (json.dumps({"context": "c", "choices": ["a", "b"], "gold": -1}), "gold = -1 with 2 choices"),
]


def test_decontamination_and_eval_refuse_the_same_lines_even_under_python_O(tmp_path):
    """Decontamination checked benchmark lines with `assert`, which -O drops: gold -1 then planted the last choice
    as the gold answer's n-grams, gold 2 an IndexError traceback, a null context the word 'none'."""
    paths = [_write(tmp_path / f"bench{i}.jsonl", [GOOD, "", bad]) for i, (bad, _) in enumerate(BAD_FOR_BOTH)]
    paths.append(tmp_path / "latin1.jsonl")
    paths[-1].write_bytes(GOOD.encode() + b"\n" + json.dumps({"context": "caf\u00e9", "choices": ["a", "b"], "gold": 0},
                                                               ensure_ascii=False).encode("latin-1") + b"\n")
    script = (
        "import sys\n"
        "from titan_k3.data.prepare.dedup import BenchmarkNgrams\n"
        "from titan_k3.eval.multiple_choice import load_task\n"
        "for p in sys.argv[1:]:\n"
        "    for read in (lambda: BenchmarkNgrams([p], 2), lambda: load_task(p)):\n"
        "        try:\n"
        "            read()\n"
        "            print('accepted')\n"
        "        except ValueError as e:\n"
        "            print(e)\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", script, *map(str, paths)], capture_output=True, text=True,
                         timeout=300, check=True).stdout.splitlines()
    expected = [(3, why) for _, why in BAD_FOR_BOTH] + [(2, "not UTF-8 (byte 17 of the line is 0xe9)")]
    assert len(out) == 2 * len(paths)
    for k, (path, (n, why)) in enumerate(zip(paths, expected)):
        for line in out[2 * k: 2 * k + 2]:
            assert line.startswith(f"task file '{path}' line {n}: ") and why in line, (why, line)


def test_a_task_line_may_hold_line_separators_inside_its_strings(tmp_path):
    # NOTE: json.dumps(ensure_ascii=False) writes U+2028 and U+0085 raw; str.splitlines() cut the line there.
    line = json.dumps({"context": "one\u2028two\x85three\x0cfour", "choices": ["a", "b"], "gold": 0}, ensure_ascii=False)
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    assert load_task(path) == [Example("one\u2028two\x85three\x0cfour", ("a", "b"), 0)]


def test_task_files_missing_empty_or_twice_named(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_task(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no examples"):
        load_task(_write(tmp_path / "empty.jsonl", [""]))
    (tmp_path / "b").mkdir()
    a, b = _write(tmp_path / "t.jsonl", [GOOD]), _write(tmp_path / "b" / "t.jsonl", [GOOD])
    with pytest.raises(ValueError, match="two files named 't'"):
        load_tasks(f"{a},{b}")
    assert list(load_tasks(f"{a}, ")) == ["t"]
    assert load_task(a) == [Example("c", ("a", "b"), 1)]
