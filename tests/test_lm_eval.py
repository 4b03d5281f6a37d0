"""EleutherAI's lm-evaluation-harness against `unweight serve`, as a user evaluates a compressed model:
a loglikelihood (multiple-choice) task through `local-completions` and a generate-until task
through `local-chat-completions`, on small local data written here (no Hub).

Each run must reach its metric; the harness's own per-choice loglikelihoods must equal those
computed in this process from `unweight.load`, and its generations those of `unweight.generate`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import unweight
from test_serve import KEY, Server

pytestmark = pytest.mark.slow  # engines and servers: pytest -m 'not slow' leaves them out

CHOICES = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"], 0),
    ("Two plus two equals", [" seven", " four", " ten"], 1),
    ("The sun rises in the", [" west", " north", " east"], 2),
    ("Water freezes at zero degrees", [" Celsius", " Kelvin"], 0),
    ("A week has seven", [" days", " months", " years"], 0),
    ("Cats are popular household", [" pets", " rocks", " engines"], 0),
]
QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("What colour is grass?", "Green"),
    ("How many legs does a spider have?", "Eight"),
]
LM_EVAL = [sys.executable, "-m", "lm_eval", "run"]
TOL = 2e-3


def write_tasks(folder: Path) -> None:
    (folder / "choice.jsonl").write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in CHOICES)
    )
    (folder / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "uw_choice.yaml").write_text(
        f"task: uw_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ntarget_delimiter: \"\"\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: "
        "\"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "uw_gen.yaml").write_text(
        f"task: uw_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{question}} Answer in one word.\"\ndoc_to_target: "
        "\"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n    ignore_case: true\n    ignore_punctuation: true\n"
    )


def run_lm_eval(server: Server, folder: Path, model: str, task: str, extra: str) -> tuple[dict, list[dict]]:
    endpoint = "completions" if model == "local-completions" else "chat/completions"
    out = folder / f"out-{task}"
    cmd = [
        *LM_EVAL,
        "--model",
        model,
        "--tasks",
        task,
        "--include_path",
        str(folder),
        "--log_samples",
        "--output_path",
        str(out),
        "--model_args",
        f"model=uw,base_url={server.url}/v1/{endpoint},num_concurrent=2,max_retries=1,{extra}",
    ]
    if model == "local-chat-completions":
        cmd.append("--apply_chat_template")
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "OPENAI_API_KEY": KEY,
        "TOKENIZERS_PARALLELISM": "false",
    }
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    return results, samples


@pytest.fixture(scope="module")
def server(uw):
    s = Server(str(uw), "--api-key", KEY, "--max-model-len", "512", "--max-batch", "4")
    yield s
    s.stop()


def test_loglikelihood_task_through_local_completions(server, uw, tmp_path):
    write_tasks(tmp_path)
    results, samples = run_lm_eval(
        server,
        tmp_path,
        "local-completions",
        "uw_choice",
        f"tokenizer={uw},tokenizer_backend=huggingface,tokenized_requests=True",
    )
    model, tok = unweight.load(uw, dtype="float32"), unweight.load_tokenizer(uw)
    correct = 0
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        question, choices, answer = CHOICES[s["doc_id"]]
        ctx = tok(question)["input_ids"]
        want = []
        for c in choices:
            whole = tok(question + c)["input_ids"]
            seq = model.new_sequence()
            lp = torch.log_softmax(model.prefill(seq, torch.tensor(whole), all_logits=True), -1)
            model.free(seq)
            want.append(sum(float(lp[k - 1, whole[k]]) for k in range(len(ctx), len(whole))))
        got = [float(resp[0][0]) for resp in s["resps"]]  # the samples file holds them as text
        assert got == pytest.approx(want, abs=TOL * 4)
        correct += max(range(len(want)), key=want.__getitem__) == answer
    assert results["acc,none"] == pytest.approx(correct / len(CHOICES))


def test_generate_until_task_through_local_chat_completions(server, uw, tmp_path):
    write_tasks(tmp_path)
    results, samples = run_lm_eval(
        server, tmp_path, "local-chat-completions", "uw_gen", "tokenizer_backend=none,tokenized_requests=False"
    )
    assert "exact_match,none" in results and 0 <= results["exact_match,none"] <= 1
    model, tok = unweight.load(uw, dtype="float32"), unweight.load_tokenizer(uw)
    for s in samples:
        q = QUESTIONS[s["doc_id"]][0]
        want = unweight.generate(
            model, tok, [{"role": "user", "content": f"{q} Answer in one word."}], max_new_tokens=12, stop=["\n"]
        ).text
        assert s["resps"][0][0] == want
