import ast
import re
from decimal import Decimal

import datasets
import gsm8k_calc.tools
import pytest
import verifiers.v1 as vf
from dataset_rows import DatasetSpec
from gsm8k_calc import Gsm8kCalcConfig, Gsm8kCalcTaskset, calculator_expressions, tool_use_score
from gsm8k_calc.answers import canonical_number, is_correct, parse_final_answer
from gsm8k_calc.problems import TEMPLATES, generate_problems, load_gsm8k
from gsm8k_calc.tools import MAX_EXPRESSION_CHARS, CalculatorError, calculator
from jsonl_files import write_jsonl
from scored_traces import scored_trace

# --- calculator


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2", "3"),
        ("(12 + 8) * 3 / 4", "15"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("7 // 2.0", "3"),
        ("17 % 5", "2"),
        ("2 ** 10", "1024"),
        ("2 ** -1", "0.5"),
        ("-(3 - 5)", "2"),
        ("+4", "4"),
        ("0.1 + 0.2", "0.3"),
        ("6.0 * 7", "42"),
        ("10 / 3", "3.33333333333"),
        ("  48 / 2  ", "24"),
    ],
)
def test_calculator_evaluates_arithmetic(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("x + 1", "names are not allowed"),
        ("abs(-3)", "function calls are not allowed"),
        ("__import__('os').system('echo hi')", "function calls are not allowed"),
        ("__import__", "names are not allowed"),
        ("(1).real", "attribute access is not allowed"),
        ("[1, 2][0]", "not allowed"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("1j * 2", "only numbers"),
        ("1,000 * 3", "commas"),
        ("2 ^ 3", "'**'"),
        ("1 < 2", "comparisons"),
        ("lambda: 1", "not allowed"),
        ("1 +", "not a valid expression"),
        ("a = 1", "not a valid expression"),
        ("1\x00", "not a valid expression"),
        ("", "empty expression"),
        ("1 / 0", "division by zero"),
        ("5 // 0", "division by zero"),
        ("5 % 0.0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** 0.5", "not a real number"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 100", "too large"),
        ("2.5 ** 1e300", "too large"),
        ("99999999 * 99999999", "too large"),
        ("1e999", "too large"),
        ("9" * 30, "too large"),
        ("1" + "+1" * MAX_EXPRESSION_CHARS, "too long"),
    ],
)
def test_calculator_refuses(expression, message):
    with pytest.raises(CalculatorError, match=re.escape(message)):
        calculator(expression)


def test_calculator_cheap_powers_of_small_bases_are_allowed(monkeypatch):
    """Bases of magnitude 1 or less to a huge exponent are computed, each by one call of Python's power (binary
    exponentiation: about 40 multiplications of numbers no larger than 1 here), never refused as too large."""
    powers = []

    def counted_power(base, exponent):
        powers.append((base, exponent))
        return pow(base, exponent)

    monkeypatch.setitem(gsm8k_calc.tools._BINARY, ast.Pow, counted_power)
    assert calculator("1 ** 999999999999") == "1"
    assert calculator("(-1) ** 999999999999") == "-1"
    assert calculator("0.5 ** 999999999999") == "0"
    assert powers == [(1, 999999999999), (-1, 999999999999), (0.5, 999999999999)]


def test_calculator_is_a_plain_tool():
    """The harness reads the tool's name, docstring and hints; arguments arrive as a string."""
    assert calculator.__name__ == "calculator"
    assert calculator.__doc__ and "arithmetic" in calculator.__doc__
    assert calculator.__annotations__ == {"expression": str, "return": str}


# --- generated problems


def recompute(template: str, n: dict[str, int]) -> int:
    """The answer of each template, computed independently from its drawn numbers."""
    if template == "shopping":
        return n["bill"] - n["packs"] * n["price"]
    if template == "savings":
        return n["weekly"] * n["weeks"] - n["spent"]
    if template == "sharing":
        shared = n["trays"] * n["per_tray"] - n["eaten"]
        assert shared % n["friends"] == 0, "the cookies must share out evenly"
        return shared // n["friends"]
    if template == "garden":
        return (n["rows"] * n["per_row"] - n["died"] + n["planted"]) * n["per_plant"]
    if template == "trip":
        return n["speed1"] * n["hours1"] + n["speed2"] * n["hours2"]
    if template == "discount":
        off = n["price"] * n["percent"] / 100
        assert off == int(off), "the discount must be whole dollars"
        return (n["price"] - int(off)) * n["count"]
    raise AssertionError(f"no recomputation for template {template!r}")


def test_generator_is_deterministic_per_seed():
    assert generate_problems(50, seed=3) == generate_problems(50, seed=3)
    assert generate_problems(50, seed=3) != generate_problems(50, seed=4)


def test_generated_answers_are_right():
    problems = generate_problems(600, seed=0)
    assert {p.source for p in problems} == set(TEMPLATES)
    for problem in problems:
        answer = recompute(problem.source, problem.numbers)
        assert problem.answer == str(answer), problem
        assert answer > 0, problem
        for value in problem.numbers.values():
            assert re.search(rf"(?<!\d){value}(?!\d)", problem.question), (value, problem.question)


# --- answer parsing


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("So she has 18 left.\n#### 18", "18"),
        ("#### 1,234", "1234"),
        ("####-7", "-7"),
        ("#### $42.00", "42"),
        ("#### 2.5", "2.5"),
        ("First 3 + 4 = 7.\n#### 7\nDouble-check: 7 * 2 = 14", "7"),
        ("The answer is \\boxed{42}.", "42"),
        ("\\boxed{\\$1,500}", "1500"),
        ("\\boxed{-3} hmm, no: \\boxed{\\text{12 apples}}", "12"),
        ("\\boxed{1\\,000}", "1000"),
        ("She pays 5 + 3 = 8 dollars.", "8"),
        ("The temperature ends at -12 degrees.", "-12"),
        ("The temperature ends at \u221212 degrees.", "-12"),
        ("5-3 leaves 2", "2"),
        ("It is (2+3)-1", "1"),
        ("12.0", "12"),
        ("no number here", None),
        ("", None),
    ],
)
def test_parse_final_answer(reply, expected):
    parsed = parse_final_answer(reply)
    assert parsed == (None if expected is None else Decimal(expected))


def test_is_correct_compares_numbers():
    assert is_correct("#### 42.0", "42")
    assert is_correct("#### 1,200", "1200")
    assert not is_correct("#### 41", "42")
    assert not is_correct("I don't know", "42")
    assert not is_correct("42 is close, but #### 43", "42")  # the marked answer wins over other numbers


def test_canonical_number():
    assert canonical_number(Decimal("1200")) == "1200"
    assert canonical_number(Decimal("42.00")) == "42"
    assert canonical_number(Decimal("-2.50")) == "-2.5"


# --- GSM8K loader


def test_load_gsm8k(tmp_path):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
            "",
            {"question": "A car costs $1,500 more than ...", "answer": "... \n#### 1,500"},
            {"question": "Round down?", "answer": "#### -4.50"},
        ],
    )
    problems = load_gsm8k(DatasetSpec(path=str(path)))
    assert [(p.answer, p.source) for p in problems] == [("5", "gsm8k"), ("1500", "gsm8k"), ("-4.5", "gsm8k")]
    assert problems[0].question == "Tom has 2 apples and buys 3. How many?"
    assert len(load_gsm8k(DatasetSpec(path=str(path)), limit=2)) == 2


@pytest.mark.parametrize(
    "bad_row, message",
    [
        ({"question": "How many?"}, "field 'answer' is missing"),
        ({"answer": "#### 3"}, "field 'question' is missing"),
        ({"question": "How many?", "answer": 3}, "field 'answer' is not a string"),
        ({"question": "How many?", "answer": "three"}, "field 'answer' must end with '#### <number>'"),
        ({"question": "How many?", "answer": "#### three"}, "field 'answer' must end with '#### <number>'"),
        ('{"question": "How many?", ', "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_load_gsm8k_names_file_line_and_field(tmp_path, bad_row, message):
    good = {"question": "q", "answer": "#### 1"}
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad_row])
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: {message}")):
        load_gsm8k(DatasetSpec(path=str(path)))


def test_load_gsm8k_missing_file(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"dataset '{tmp_path / 'nope.jsonl'}' not found")):
        load_gsm8k(DatasetSpec(path=str(tmp_path / "nope.jsonl")))


# --- the taskset, through verifiers


def test_taskset_loads_by_id_and_iterates():
    config = vf.SingleAgentEnvConfig(
        taskset={"id": "gsm8k-calc", "num_examples": 5, "seed": 1, "max_turns": 3},
        agent=vf.AgentConfig(runtime=vf.SubprocessConfig()),
    )
    assert isinstance(config.taskset, Gsm8kCalcConfig)
    taskset = vf.load_taskset(config.taskset)
    assert isinstance(taskset, Gsm8kCalcTaskset)
    tasks = list(taskset.take(3))
    assert [t.data.idx for t in tasks] == [0, 1, 2]
    problems = generate_problems(5, seed=1)
    for task, problem in zip(tasks, problems, strict=False):
        assert task.data.tools == ["gsm8k_calc.tools:calculator"]
        assert task.data.final_tools == []
        assert task.data.max_turns == 3
        assert task.data.prompt == problem.question
        assert task.data.answer == problem.answer
        assert "calculator" in task.data.system_prompt and "####" in task.data.system_prompt
    assert len(list(taskset)) == 5


def test_taskset_reads_dataset_path(tmp_path):
    path = write_jsonl(tmp_path / "test.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(4)])
    taskset = Gsm8kCalcTaskset(Gsm8kCalcConfig(dataset_path=str(path)))
    assert [(t.data.prompt, t.data.answer, t.data.source) for t in taskset] == [
        (f"q{i}", str(i), "gsm8k") for i in range(4)
    ]
    assert len(list(Gsm8kCalcTaskset(Gsm8kCalcConfig(dataset_path=str(path), num_examples=2)))) == 2


def test_taskset_reads_a_split_of_a_saved_gsm8k_dataset(tmp_path):
    # GSM8K as `datasets` saves it after load_dataset("openai/gsm8k", "main"): a train and a test split
    rows = {
        split: [{"question": f"{split} q{i}", "answer": f"steps\n#### {i}"} for i in range(3)]
        for split in ("train", "test")
    }
    datasets.DatasetDict({split: datasets.Dataset.from_list(r) for split, r in rows.items()}).save_to_disk(
        tmp_path / "gsm8k"
    )
    config = Gsm8kCalcConfig(dataset={"path": str(tmp_path / "gsm8k"), "split": "test"}, num_examples=2)
    assert [(t.data.prompt, t.data.answer) for t in Gsm8kCalcTaskset(config)] == [("test q0", "0"), ("test q1", "1")]


def test_taskset_fails_on_load_for_a_bad_file(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "q"}])
    with pytest.raises(ValueError, match="bad.jsonl:1: field 'answer' is missing"):
        Gsm8kCalcTaskset(Gsm8kCalcConfig(dataset_path=str(path)))


# --- rewards


def calc_call(arguments: str, name: str = "calculator") -> vf.AssistantMessage:
    return vf.AssistantMessage(tool_calls=[vf.ToolCall(id="c", name=name, arguments=arguments)])


def test_calculator_expressions_and_tool_use_score():
    messages = [
        calc_call('{"expression": "2 + 2"}'),
        calc_call("not json"),
        calc_call('{"expression": 4}'),
        calc_call('{"expression": "x"}', name="search"),
        vf.AssistantMessage(content="#### 4"),
    ]
    expressions = calculator_expressions(messages)
    assert expressions == ["2 + 2", None, None]
    assert tool_use_score(expressions) == 1.0
    assert tool_use_score([None, "os.system('x')", "1/0"]) == 0.0
    assert tool_use_score([]) == 0.0


def test_rewards_and_metric_through_verifiers_scoring():
    task = next(iter(Gsm8kCalcTaskset(Gsm8kCalcConfig(num_examples=1))))
    answer = task.data.answer

    trace = scored_trace(task, [calc_call('{"expression": "1 + 1"}'), vf.AssistantMessage(content=f"#### {answer}")])
    assert {k: (r.score, r.weight) for k, r in trace.rewards.items()} == {
        "correct_answer": (1.0, 1.0),
        "tool_use": (1.0, 0.1),
    }
    assert trace.metrics == {"calculator_calls": 1.0}
    assert trace.reward == pytest.approx(1.1)

    trace = scored_trace(task, [calc_call('{"expression": "import os"}'), vf.AssistantMessage(content="#### 0.5")])
    assert (trace.rewards["correct_answer"].score, trace.rewards["tool_use"].score) == (0.0, 0.0)


def test_reward_weights_come_from_the_config():
    config = Gsm8kCalcConfig(num_examples=1, correct_answer_weight=2.0, tool_use_weight=0.0)
    task = next(iter(Gsm8kCalcTaskset(config)))
    answer = vf.AssistantMessage(content=f"#### {task.data.answer}")
    trace = scored_trace(task, [calc_call('{"expression": "3 * 3"}'), answer])
    assert (trace.rewards["correct_answer"].weight, trace.rewards["tool_use"].weight) == (2.0, 0.0)
    assert trace.reward == pytest.approx(2.0)
