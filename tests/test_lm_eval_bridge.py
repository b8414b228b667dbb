"""lm-evaluation-harness bridge: its numbers equal lm-eval's own ``hf`` model for one model, and
a composition's log-likelihoods equal ``Candidate.score``; spec files and the command line.

Everything is offline: two local tasks (tests/fixtures/lm_eval, JSONL data), tiny models built
from configs, and a socket guard that fails the module if anything opens a network connection.
"""

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import yaml
from _reference import require

lm_eval = require("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from mergelab.candidate import GenerationSettings  # noqa: E402
from mergelab.compose import ComposedDecoder  # noqa: E402
from mergelab.eval import lm_eval_bridge  # noqa: E402
from mergelab.eval.lm_eval_bridge import MergelabLM  # noqa: E402
from mergelab.eval.spec import build_candidate, parse_candidate_spec  # noqa: E402
from mergelab.merge import merge_models  # noqa: E402
from mergelab.model_candidate import ModelCandidate  # noqa: E402
from mergelab.tiny import char_tokenizer, tiny_causal_lm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "fixtures" / "lm_eval"
MC, GEN = "mergelab_tiny_mc", "mergelab_tiny_gen"
ATOL = 1e-4  # left-padded, masked batches vs lm-eval's right-padded unmasked ones


@pytest.fixture(scope="module", autouse=True)
def offline():
    """No network, and the tasks' relative data paths resolve against the repository root."""
    attempts = []
    real_connect = socket.socket.connect

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError(f"network access attempted in an offline test: {address}")
        return real_connect(sock, address)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket.socket, "connect", guarded)
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        mp.chdir(ROOT)
        yield
    assert not attempts, f"lm-eval or mergelab tried to reach the network: {attempts}"


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def models(tok):
    return [tiny_causal_lm(len(tok), seed=s, initializer_range=0.3) for s in range(3)]


@pytest.fixture(scope="module")
def task_manager():
    return TaskManager(include_path=str(TASKS), include_defaults=False)


@pytest.fixture(scope="module")
def hf_runs(models, tok, task_manager):
    """lm-eval's own hf model on both tasks: the reference numbers."""
    lm = HFLM(pretrained=models[0], tokenizer=tok, batch_size=4)
    return {task: _evaluate(lm, task, task_manager) for task in (MC, GEN)}


@pytest.fixture(scope="module")
def composed(models, tok):
    return ComposedDecoder(models[0], models[1:], tok, weights=[1.0, 0.5], eos_policy="max")


def _evaluate(lm, task, task_manager):
    return lm_eval.simple_evaluate(
        model=lm, tasks=[task], task_manager=task_manager, log_samples=True
    )


def _responses(run, task):
    return [s["resps"] for s in sorted(run["samples"][task], key=lambda s: s["doc_id"])]


def test_multiple_choice_equals_the_hf_model(models, tok, task_manager, hf_runs):
    ours = _evaluate(MergelabLM(ModelCandidate(models[0], tok), batch_size=3), MC, task_manager)
    theirs = hf_runs[MC]
    greedy_seen = set()
    for a, b in zip(_responses(ours, MC), _responses(theirs, MC), strict=True):
        for [(ll_a, greedy_a)], [(ll_b, greedy_b)] in zip(a, b, strict=True):
            assert ll_a == pytest.approx(ll_b, abs=ATOL)
            assert greedy_a == greedy_b
            greedy_seen.add(greedy_a)
    assert greedy_seen == {True, False}  # the fixture has one greedy continuation
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"][MC][metric] == theirs["results"][MC][metric]


def test_generate_until_equals_the_hf_model(models, tok, task_manager, hf_runs):
    ours = _evaluate(MergelabLM(ModelCandidate(models[0], tok), batch_size=2), GEN, task_manager)
    theirs = hf_runs[GEN]
    texts = [text for [[text]] in _responses(ours, GEN)]
    assert texts == [text for [[text]] in _responses(theirs, GEN)]
    # The fixture exercises both endings: a stop sequence and the 16-token limit.
    prompts = [
        s["arguments"][0][0] for s in sorted(ours["samples"][GEN], key=lambda s: s["doc_id"])
    ]
    gens = ModelCandidate(models[0], tok).generate(
        prompts, GenerationSettings(max_new_tokens=16, stop_strings=("*", "\n"))
    )
    assert [g.text for g in gens] == texts
    assert {g.finish_reason for g in gens} == {"stop_string", "length"}
    assert ours["results"][GEN]["exact_match,none"] == theirs["results"][GEN]["exact_match,none"]


def test_rolling_loglikelihood_equals_the_hf_model(models, tok):
    # Strings longer than the 12-token window: several disjoint windows per string.
    texts = ["the cat sat on the mat and the dog sat on the log.", "2 + 2 = 4, 3 + 3 = 6", "ab"]
    requests = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    ours = MergelabLM(ModelCandidate(models[0], tok), max_length=12).loglikelihood_rolling(requests)
    theirs = HFLM(pretrained=models[0], tokenizer=tok, max_length=12).loglikelihood_rolling(
        requests
    )
    assert ours == pytest.approx(theirs, abs=ATOL)
    # One window: the whole string given BOS, as Candidate.score computes it.
    single = ModelCandidate(models[0], tok).score([""], [texts[2]])
    assert ours[2] == pytest.approx(single[0], abs=1e-5)


def test_long_prompts_are_cut_like_the_hf_model(models, tok):
    long = "the cat sat on the mat and the dog sat on the log " * 2
    gen_kwargs = {"until": ["*"], "max_gen_toks": 8, "do_sample": False}
    requests = [
        Instance("generate_until", {}, (p, gen_kwargs), i) for i, p in enumerate([long, "ab"])
    ]
    with pytest.warns(UserWarning, match="cut to their last 16"):
        ours = MergelabLM(ModelCandidate(models[0], tok), max_length=24).generate_until(requests)
    theirs = HFLM(pretrained=models[0], tokenizer=tok, max_length=24).generate_until(requests)
    assert ours == theirs


def test_composition_loglikelihoods_equal_candidate_score(composed, task_manager):
    run = _evaluate(MergelabLM(composed, batch_size=4), MC, task_manager)
    samples = run["samples"][MC]
    pairs = [tuple(args) for s in samples for args in s["arguments"]]
    got = [ll for s in samples for [(ll, _)] in s["resps"]]
    expected = composed.score([c for c, _ in pairs], [x for _, x in pairs])
    assert got == pytest.approx(expected, abs=1e-5)


def test_lora_composition_loglikelihoods_equal_candidate_score(models, tok):
    from peft import LoraConfig, get_peft_model

    adapters = []
    for seed, targets in [(1, ["c_attn"]), (2, ["c_fc"])]:
        config = LoraConfig(
            r=2, lora_alpha=4, target_modules=targets, fan_in_fan_out=True, init_lora_weights=False
        )
        torch.manual_seed(seed)
        adapters.append(get_peft_model(copy.deepcopy(models[0]), config).eval())
    decoder = ComposedDecoder.from_lora(models[0], adapters, tok)
    pairs = [("2 + 2 =", " 4"), ("the cat", " sat"), ("", "abc")]
    requests = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    got = [ll for ll, _ in MergelabLM(decoder).loglikelihood(requests)]
    assert got == pytest.approx(decoder.score(*zip(*pairs)), abs=1e-5)


def test_generation_arguments_map_onto_settings_and_unknown_ones_are_refused(composed):
    lm = MergelabLM(composed, batch_size=2, seed=7)
    settings, until = lm.decoding_settings(
        {"until": ["\n\n"], "max_gen_toks": 5, "do_sample": True, "temperature": 0.7, "top_p": 0.9}
    )
    assert until == ["\n\n", "<eos>"]  # lm-eval adds the EOS text
    assert (settings.max_new_tokens, settings.do_sample, settings.temperature) == (5, True, 0.7)
    assert (settings.top_p, settings.seed, settings.stop_strings) == (0.9, 7, ("\n\n",))
    assert settings.top_k == 50  # transformers' default when sampling, as the hf model samples
    penalised, _ = lm.decoding_settings({"until": ".", "repetition_penalty": 1.3})
    assert penalised.repetition_penalty == 1.3
    greedy, _ = lm.decoding_settings({"until": ".", "temperature": 0.0})
    assert not greedy.do_sample and greedy.max_new_tokens == 256
    with pytest.raises(ValueError, match="typical_p"):
        lm.decoding_settings({"until": ".", "typical_p": 0.5})
    # Sampling is seeded per prompt: the same request gives the same text.
    req = [Instance("generate_until", {}, ("ab", {"do_sample": True, "max_gen_toks": 6}), 0)]
    assert lm.generate_until(req) == lm.generate_until(req)


@pytest.fixture(scope="module")
def folders(models, tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_models")
    for name, model in zip(["base", "math", "code"], models):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def test_spec_files_build_models_compositions_and_merges(folders, models, tok, composed):
    pairs = [("2 + 2 =", " 4"), ("the cat", " sat"), ("", "abc")]
    requests = [Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)]
    spec = folders / "compose.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "base": "base",
                "experts": ["math", "code"],
                "expert_names": ["math", "code"],
                "weights": [1.0, 0.5],
                "eos_policy": "max",
                "name": "math+code",
            }
        )
    )
    from lm_eval.api.registry import get_model

    lm = get_model("mergelab").create_from_arg_string(f"spec={spec},batch_size=2")
    assert lm.candidate.name == "math+code" and lm.batch_size == 2
    reference = MergelabLM(composed).loglikelihood(requests)
    assert [x for x, _ in lm.loglikelihood(requests)] == pytest.approx(
        [x for x, _ in reference], abs=1e-5
    )

    merge = folders / "merge.yaml"
    merge.write_text(
        yaml.safe_dump(
            {
                "merge": {
                    "method": "task_arithmetic",
                    "base": "base",
                    "models": ["math", "code"],
                    "parameters": {"weight": 0.5},
                }
            }
        )
    )
    merged = build_candidate(merge)
    expected = ModelCandidate(
        merge_models("task_arithmetic", models[0], models[1:], params={"weight": 0.5}), tok
    )
    assert merged.score(*zip(*pairs)) == pytest.approx(expected.score(*zip(*pairs)), abs=1e-5)
    # A model folder is a spec too.
    single = build_candidate(folders / "base")
    assert single.score(*zip(*pairs)) == pytest.approx(
        ModelCandidate(models[0], tok).score(*zip(*pairs)), abs=1e-5
    )


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"base": "b", "experts": ["e"], "wieghts": [1]}, "unknown key"),
        ({"model": "m", "base": "b"}, "exactly one"),
        ({"model": "m", "weights": [1.0]}, "only apply to a composition"),
        ({"base": "b", "experts": ["e"], "weights": [1, 2]}, "2 weights for 1 experts"),
        ({"base": "b", "experts": ["e"], "eos_policy": "never"}, "eos_policy"),
        ({"merge": {"merge_method": "ties", "models": []}}, "mergekit's dialect"),
        ({"model": "m", "dtype": "int3"}, "int3"),
    ],
)
def test_bad_specs_are_refused_naming_the_key(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_candidate_spec(raw)


def test_command_line_runs_a_composition(folders, composed, task_manager, tmp_path):
    from lm_eval import tasks as lm_eval_tasks

    from mergelab.eval import lm_eval_bridge

    spec = folders / "cli.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "base": str(folders / "base"),
                "weights": [1.0, 0.5],
                "experts": [str(folders / "math"), str(folders / "code")],
                "eos_policy": "max",
            }
        )
    )
    out = tmp_path / "out"

    class LocalTasksOnly(TaskManager):  # skip indexing lm-eval's ~10k built-in task files
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval_tasks, "TaskManager", LocalTasksOnly)
        lm_eval_bridge.main(
            [
                "--model",
                "mergelab",
                "--model_args",
                f"spec={spec}",
                "--tasks",
                MC,
                "--include_path",
                str(TASKS),
                "--batch_size",
                "4",
                "--output_path",
                str(out),
            ]
        )
    [results_file] = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    expected = _evaluate(MergelabLM(composed), MC, task_manager)["results"][MC]
    assert results["results"][MC]["acc,none"] == expected["acc,none"]
    assert results["config"]["mergelab_candidate"]["type"] == "ComposedDecoder"


def test_model_args_take_lm_evals_names(folders, models, tok):
    """pretrained= (as the hf model), dtype (auto: as stored), batch_size in model_args winning
    over lm-eval's own --batch_size, which the hf model would refuse as given twice."""
    from lm_eval.api.registry import get_model

    cls = get_model("mergelab")
    lm = cls.create_from_arg_obj(
        {
            "pretrained": str(folders / "base"),
            "dtype": "bfloat16",
            "batch_size": "4",
            "trust_remote_code": False,
            "device": "cpu",
        },
        {"batch_size": 1, "max_batch_size": None, "device": None},
    )
    assert lm.batch_size == 4 and lm.candidate.model.dtype == torch.bfloat16
    lm = cls.create_from_arg_string(f"pretrained={folders / 'base'},dtype=auto,batch_size=auto")
    assert lm.batch_size == 8 and lm.candidate.model.dtype == torch.float32
    lm = cls.create_from_arg_string(f"spec={folders / 'base'}", {"batch_size": 2})
    assert lm.batch_size == 2  # lm-eval's --batch_size applies when model_args do not say


def _bridge_command(monkeypatch, argv):
    """(exit code, stdout, stderr) of ``mergelab-lm-eval *argv`` run in this process."""
    import contextlib
    import io
    import sys

    monkeypatch.setattr(sys, "argv", ["mergelab-lm-eval"])
    monkeypatch.delenv("MERGELAB_DEBUG", raising=False)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            lm_eval_bridge.main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        ("spec=missing.yaml", "candidate spec missing.yaml not found"),
        ("spec={base},colour=red", "unknown key(s) ['colour']"),
        ("spec={base},dtype=float8", "unknown dtype 'float8'"),
        ("spec={base},batch_size=x", "batch_size must be a whole number, got 'x'"),
        ("spec={base},batch_size=0", "batch_size must be at least 1"),
        ("spec={base},pretrained={base}", "exactly one"),
        ("dtype=float32", "give spec=<spec file or model folder>"),
        ("spec={base},trust_remote_code=maybe", "trust_remote_code must be true or false"),
    ],
)
def test_bad_model_args_are_one_line_and_exit_2(folders, monkeypatch, model_args, message):
    argv = [
        "--model",
        "mergelab",
        "--model_args",
        model_args.format(base=folders / "base"),
        "--tasks",
        MC,
        "--include_path",
        TASKS,
    ]
    code, _, err = _bridge_command(monkeypatch, argv)
    assert code == 2, err
    assert "Traceback" not in err
    [line] = [x for x in err.strip().splitlines() if x.startswith("mergelab-lm-eval")]
    assert err.strip().endswith(line) and line.startswith("mergelab-lm-eval: error: ")
    assert message in line


def test_help_explains_spec(monkeypatch):
    code, out, _ = _bridge_command(monkeypatch, ["--help"])
    assert code == 0
    ours, _, theirs = out.partition("lm-eval's own help follows.")
    assert "spec=compose.yaml" in ours and "pretrained=" in ours
    assert all(f"  {key} " in ours for key in lm_eval_bridge.MODEL_ARGS)
    assert "run" in theirs  # lm-eval's own help follows


def test_command_line_takes_pretrained_and_batch_size(folders, models, tok, task_manager, tmp_path):
    from lm_eval import tasks as lm_eval_tasks

    bridge = lm_eval_bridge
    seen = []
    real = bridge.MergelabLM._loglikelihood_tokens

    def spy(self, requests, disable_tqdm=False):
        seen.append(self.batch_size)
        return real(self, requests, disable_tqdm)

    class LocalTasksOnly(TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lm_eval_tasks, "TaskManager", LocalTasksOnly)
        mp.setattr(bridge.MergelabLM, "_loglikelihood_tokens", spy)
        code, _, err = _bridge_command(
            mp,
            [
                "run",
                "--model",
                "mergelab",
                "--model_args",
                f"pretrained={folders / 'base'}",
                "batch_size=3",
                "dtype=float32",
                "--tasks",
                MC,
                "--include_path",
                TASKS,
                "--output_path",
                out,
            ],
        )
    assert code == 0, err
    assert seen and set(seen) == {3}
    [results_file] = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())
    expected = _evaluate(MergelabLM(ModelCandidate(models[0], tok)), MC, task_manager)
    assert results["results"][MC]["acc,none"] == expected["results"][MC]["acc,none"]


def test_the_bridge_is_a_console_script():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("mergelab-lm-eval") == "mergelab.eval.lm_eval_bridge:main"
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"


def test_requests_with_the_same_input_share_one_forward(models, tok):
    """Choices that differ only in their last token feed the model the same input: one forward
    serves them all (as in lm-eval's hf model), with the numbers of scoring each alone."""
    candidate = ModelCandidate(models[0], tok)
    lm = MergelabLM(candidate, batch_size=2)
    context = tok("the answer is")["input_ids"]
    requests = [(None, context, tok(f" 5{d}")["input_ids"]) for d in "0123"]
    requests.append((None, tok("ab")["input_ids"], tok("cd")["input_ids"]))
    before = candidate.runner.forward_passes
    shared = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert candidate.runner.forward_passes - before == 1  # two distinct inputs, one batch
    alone = [lm._loglikelihood_tokens([r], disable_tqdm=True)[0] for r in requests]
    assert [g for _, g in shared] == [g for _, g in alone]
    assert [s for s, _ in shared] == pytest.approx([s for s, _ in alone], abs=ATOL)


def test_usage_counts_each_documents_tokens_and_time(models, tok):
    """What compare reports as an lm-eval row's cost: per (task, doc_id), the tokens the model
    generated (generate_until) or scored (loglikelihood: every continuation token; rolling:
    every window), and its time."""
    candidate = ModelCandidate(models[0], tok)
    lm = MergelabLM(candidate, batch_size=2, progress=False)
    gen_kwargs = {"until": ["*"], "max_gen_toks": 6, "do_sample": False}
    prompts = ["the cat", "ab", "hello"]
    generate = [
        Instance("generate_until", {}, (p, gen_kwargs), i, ("t", i, 1))
        for i, p in enumerate(prompts)
    ]
    lm.generate_until(generate)
    gens = candidate.generate(prompts, GenerationSettings(max_new_tokens=6, stop_strings=("*",)))
    for i, g in enumerate(gens):
        used = lm.usage[("t", i)]
        assert used["generated_tokens"] == len(g.token_ids) and used["scored_tokens"] == 0
        assert used["seconds"] > 0 and used["forward_calls"] > 0
    choices = [" a", " bc", " def"]
    score = [
        Instance("loglikelihood", {}, ("the cat is", c), j, ("s", 7, 1))
        for j, c in enumerate(choices)
    ]
    lm.loglikelihood(score)
    assert lm.usage[("s", 7)]["scored_tokens"] == sum(len(c) for c in choices)  # one per char
    text = "hello world, the cat sat on the mat"  # 35 characters: 3 windows of 12 tokens
    lm = MergelabLM(candidate, batch_size=2, max_length=12, progress=False)
    lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0, ("r", 0, 1))])
    assert lm.usage[("r", 0)]["scored_tokens"] == len(tok(text)["input_ids"])
    assert lm.usage[("r", 0)]["generated_tokens"] == 0
