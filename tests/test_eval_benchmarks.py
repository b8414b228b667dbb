"""Benchmark loaders (every format, from small fixtures), their errors, and prompts."""

import gzip
import json
from pathlib import Path

import pytest

from mergelab.eval.benchmarks import (
    Benchmark,
    BenchmarkFormatError,
    Item,
    load_gsm8k,
    load_humaneval,
    load_humaneval_plus,
    load_math,
    load_mbpp,
    load_mbpp_plus,
)
from mergelab.eval.prompts import (
    HUMANEVAL_STOPS,
    MBPP_STOPS,
    PromptConfig,
    build_prompt,
    load_exemplars,
    stop_strings,
)
from mergelab.eval.scoring_math import math_answers_equal
from mergelab.eval.tasks import load_benchmark

FIXTURES = Path(__file__).parent / "fixtures" / "eval"


def test_bundled_humaneval_loads_out_of_the_box():
    bench = load_humaneval()
    assert (bench.name, bench.task, len(bench)) == ("humaneval", "humaneval", 164)
    first = bench.items[0]
    assert first.item_id == "HumanEval/0"
    assert first.tests.entry_point == "has_close_elements"
    assert first.tests.prompt_is_code and "def check(candidate)" in first.tests.check
    assert len(load_humaneval(limit=5)) == 5


def test_humaneval_plus_fixture_and_override_env(monkeypatch):
    path = FIXTURES / "humaneval_plus.jsonl"
    bench = load_humaneval_plus(path)
    assert [it.item_id for it in bench.items] == ["HumanEval/0", "HumanEval/2", "HumanEval/32"]
    t = bench.items[1].tests
    assert t.atol == 1e-6 and t.base_inputs == [[3.5], [1.33], [123.456]] and t.has_plus
    assert t.canonical_solution.startswith(bench.items[1].prompt)
    monkeypatch.setenv("HUMANEVAL_OVERRIDE_PATH", str(path))
    assert load_benchmark("humaneval+").fingerprint() == bench.fingerprint()
    monkeypatch.delenv("HUMANEVAL_OVERRIDE_PATH")
    with pytest.raises(FileNotFoundError, match="HUMANEVAL_OVERRIDE_PATH"):
        load_humaneval_plus()


def test_mbpp_plus_restores_tuple_inputs(monkeypatch):
    monkeypatch.setenv("MBPP_OVERRIDE_PATH", str(FIXTURES / "mbpp_plus.jsonl"))
    bench = load_mbpp_plus()
    mbpp2 = bench.items[0]
    assert mbpp2.item_id == "Mbpp/2" and not mbpp2.tests.prompt_is_code
    # EvalPlus stores Mbpp/2's tuples as JSON lists; they are tuples again when called.
    assert mbpp2.tests.base_inputs[0] == [(3, 4, 5, 6), (5, 7, 4, 10)]
    assert bench.items[1].tests.plus_inputs[0] == [1]  # other tasks untouched


def test_mbpp_original_and_sanitized_formats():
    orig = load_mbpp(FIXTURES / "mbpp.jsonl")
    assert [it.item_id for it in orig.items] == ["Mbpp/11", "Mbpp/12"]
    assert orig.items[0].tests.entry_point == "remove_Occ"
    assert "Your code should pass these tests" in orig.items[0].prompt
    assert 'assert remove_Occ("hello","l") == "heo"' in orig.items[0].prompt
    san = load_mbpp(FIXTURES / "mbpp_sanitized.json")
    assert san.items[0].tests.entry_point == "similar_elements"  # found inside set(...)
    assert san.items[1].tests.setup == "import math"


def test_gsm8k_and_math_loaders():
    gsm = load_gsm8k(FIXTURES / "gsm8k.jsonl")
    assert [it.answer for it in gsm.items] == ["72", "5000", "-7"]
    math = load_math(FIXTURES / "math.jsonl")
    assert [it.answer for it in math.items] == [r"\frac{5}{6}", "-4", r"\frac{2\sqrt{2}}{3}"]
    assert math.items[0].meta["level"] == "Level 1" and math.items[0].meta["type"] == "Prealgebra"
    tree = load_math(FIXTURES / "math_dir")  # MATH's own layout: test/<type>/<n>.json
    assert [it.item_id for it in tree.items] == ["test/algebra/1", "test/geometry/7"]
    assert math_answers_equal(tree.items[1].answer, "9")  # "9\text{ cm}^2"


def test_gzipped_jsonl_is_read(tmp_path):
    src = (FIXTURES / "gsm8k.jsonl").read_bytes()
    gz = tmp_path / "gsm8k.jsonl.gz"
    gz.write_bytes(gzip.compress(src))
    assert len(load_gsm8k(gz)) == 3


def test_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    bad.write_text(good + "\n" + "{not json\n")
    with pytest.raises(BenchmarkFormatError, match=r"bad\.jsonl:2: malformed JSON"):
        load_gsm8k(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text(good + "\n\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(BenchmarkFormatError, match=r"missing\.jsonl:3: .*\['answer'\]"):
        load_gsm8k(missing)
    no_marker = tmp_path / "nomarker.jsonl"
    no_marker.write_text(json.dumps({"question": "q", "answer": "it is 4"}) + "\n")
    with pytest.raises(BenchmarkFormatError, match=r"nomarker\.jsonl:1: .*####"):
        load_gsm8k(no_marker)
    he = tmp_path / "he.jsonl"
    he.write_text(json.dumps({"task_id": "x", "prompt": "p", "entry_point": "f"}) + "\n")
    with pytest.raises(BenchmarkFormatError, match=r"he\.jsonl:1: .*canonical_solution"):
        load_humaneval_plus(he)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_math(tmp_path / "nope.jsonl")
    with pytest.raises(KeyError, match="unknown benchmark"):
        load_benchmark("triviaqa", tmp_path)


def test_in_memory_benchmarks_and_fingerprints():
    a = Benchmark.from_items("toy", "gsm8k", [{"item_id": "a", "prompt": "1+1?", "answer": "2"}])
    b = Benchmark.from_items("toy", "gsm8k", [Item("a", "1+1?", answer="2")])
    c = Benchmark.from_items("toy", "gsm8k", [Item("a", "1+1?", answer="3")])
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    code = Benchmark.from_items(
        "toy-code",
        "code",
        [{"prompt": "def f():\n", "tests": {"entry_point": "f", "asserts": ["assert f() == 1"]}}],
    )
    assert code.items[0].tests.asserts == ("assert f() == 1",)
    with pytest.raises(ValueError, match="duplicate item_id"):
        Benchmark.from_items("dup", "math", [Item("x", "p"), Item("x", "q")])
    with pytest.raises(ValueError, match="without tests"):
        Benchmark.from_items("nocode", "code", [Item("x", "p")])
    with pytest.raises(ValueError, match="unknown task"):
        Benchmark("x", "trivia", [])


def test_gsm8k_prompt_is_the_standard_8_shot_chain_of_thought():
    shots = load_exemplars("gsm8k_cot_8shot")
    assert len(shots) == 8 and shots[0]["question"].startswith("There are 15 trees")
    bench = load_gsm8k(FIXTURES / "gsm8k.jsonl")
    prompt = build_prompt(bench.items[0], bench)
    assert prompt.count("Q: ") == 9 and prompt.count("The answer is") == 8
    assert prompt.endswith(f"Q: {bench.items[0].prompt}\nA:")
    zero = build_prompt(bench.items[0], bench, PromptConfig(n_shots=0))
    assert zero == f"Q: {bench.items[0].prompt}\nA:"
    assert "Q:" in stop_strings(bench)
    with pytest.raises(ValueError, match="9-shot"):
        build_prompt(bench.items[0], bench, PromptConfig(n_shots=9))


def test_math_prompt_is_two_shot_with_boxed_answers():
    bench = load_math(FIXTURES / "math.jsonl")
    prompt = build_prompt(bench.items[0], bench)
    assert prompt.count("Problem:\n") == 3 and prompt.count("\\boxed{") == 2
    assert prompt.endswith("Solution:\n")
    assert "Problem:" in stop_strings(bench)


def test_code_prompts_and_stop_strings():
    he = load_humaneval(limit=2)
    assert build_prompt(he.items[0], he) == he.items[0].prompt
    assert stop_strings(he) == HUMANEVAL_STOPS
    mbpp = load_mbpp(FIXTURES / "mbpp.jsonl")
    assert stop_strings(mbpp) == MBPP_STOPS and "\ndef " not in MBPP_STOPS
    assert stop_strings(he, PromptConfig(stop_strings=("END",))) == ("END",)


def _chat_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    )
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


def test_chat_template_is_used_when_asked_and_available():
    tok = _chat_tokenizer()
    he = load_humaneval(limit=1)
    plain = build_prompt(he.items[0], he, PromptConfig(), tok)
    assert plain == he.items[0].prompt  # default "never": the paper's base-model protocol
    chat = build_prompt(
        he.items[0], he, PromptConfig(chat_template="auto", system_prompt="Be brief."), tok
    )
    assert chat.startswith("<|system|>Be brief.\n<|user|>Complete the following Python code")
    assert chat.endswith("<|assistant|>") and "```python\n" + he.items[0].prompt in chat
    assert stop_strings(he, PromptConfig(chat_template="auto"), tok) == ()
    # "auto" without a template falls back to plain text; "always" refuses.
    assert build_prompt(he.items[0], he, PromptConfig(chat_template="auto"), None) == plain
    with pytest.raises(ValueError, match="no chat template"):
        build_prompt(he.items[0], he, PromptConfig(chat_template="always"), None)


def test_gsm8k_integer_answer_is_the_final_answer_other_types_are_refused(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    records = [{"question": "2 + 70?", "answer": 72}, {"question": "q", "answer": "so #### 1,000"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    bench = load_gsm8k(data)
    assert [it.answer for it in bench.items] == ["72", "1000"]
    assert bench.items[0].solution is None
    for bad, shown in [(7.5, "float 7.5"), (None, "NoneType null"), ([72], r"list \[72\]")]:
        data.write_text(
            json.dumps(records[1]) + "\n" + json.dumps({"question": "q", "answer": bad})
        )
        with pytest.raises(
            BenchmarkFormatError, match=rf"gsm8k\.jsonl:2: field 'answer' .*{shown}"
        ):
            load_gsm8k(data)
    data.write_text(json.dumps({"question": ["q"], "answer": "#### 1"}) + "\n")
    with pytest.raises(
        BenchmarkFormatError, match=r"gsm8k\.jsonl:1: field 'question' must be a string"
    ):
        load_gsm8k(data)


def test_a_latin1_file_is_named_with_the_byte_offset(tmp_path):
    good = json.dumps({"question": "q", "answer": "#### 1"}) + "\n"
    data = tmp_path / "latin1.jsonl"
    data.write_bytes((good + good.replace('"q"', '"café?"')).encode("latin-1"))
    offset = len(good) + good.index('"q"') + len('"caf')
    message = rf"latin1\.jsonl:2: not UTF-8 text: byte 0xe9 at byte offset {offset} in the file"
    with pytest.raises(BenchmarkFormatError, match=message):
        load_gsm8k(data)
    gz = tmp_path / "latin1.jsonl.gz"
    gz.write_bytes(gzip.compress(data.read_bytes()))
    with pytest.raises(BenchmarkFormatError, match=rf"{offset} of the uncompressed data"):
        load_gsm8k(gz)
    as_json = tmp_path / "latin1.json"
    as_json.write_bytes(f'[\n{good.strip()},\n{good.strip()}, "é"]'.encode("latin-1"))
    with pytest.raises(BenchmarkFormatError, match=r"latin1\.json:3: not UTF-8 text: byte 0xe9"):
        load_gsm8k(as_json)
    # A UTF-8 byte-order mark is not an error.
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + good.encode())
    assert len(load_gsm8k(bom)) == 1


def test_other_malformed_files_name_file_and_line(tmp_path):
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(BenchmarkFormatError, match=r"broken\.jsonl\.gz: not a readable gzip file"):
        load_gsm8k(broken)
    scalar = tmp_path / "scalar.json"
    scalar.write_text("42")
    with pytest.raises(BenchmarkFormatError, match=r"scalar\.json: expected a JSON list"):
        load_gsm8k(scalar)
    mbpp = tmp_path / "mbpp.jsonl"
    mbpp.write_text(json.dumps({"task_id": 1, "text": "t", "code": "x", "test_list": "assert f()"}))
    with pytest.raises(
        BenchmarkFormatError, match=r"mbpp\.jsonl:1: field 'test_list' must be a list"
    ):
        load_mbpp(mbpp)
    math_file = tmp_path / "math.jsonl"
    math_file.write_text(json.dumps({"problem": "p", "solution": "s", "answer": ["1"]}) + "\n")
    with pytest.raises(BenchmarkFormatError, match=r"math\.jsonl:1: field 'answer' must be"):
        load_math(math_file)


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_a_limit_below_one_is_refused_not_read_as_all(limit):
    bench = load_humaneval()
    with pytest.raises(ValueError, match="limit must be a whole number"):
        load_humaneval(limit=limit)
    with pytest.raises(ValueError, match="limit must be a whole number"):
        bench.head(limit)
    assert len(bench.head(2)) == 2 and len(bench.head(None)) == len(bench)
