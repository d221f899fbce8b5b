"""The README and docs/. The walk-through (parity stage, a few minutes): the README's commands,
top to bottom, on the Quick start's model, then those of the docs it sends fine-tuning,
probing and conversion readers to (pretraining with small step counts appended, the
fine-tuning tasks on small task files, feature extraction, probing, the conversions and the
Python snippet), each as written apart from the placeholders; every one must succeed with a
quiet console, and transformers loads the Hugging Face exports. The fast checks: the README
stays a front door (under 200 lines), its and docs/' links resolve, and no README, docs/ or
benchmarks/ file carries a path of one particular machine."""

import glob
import json
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

from bertjax.data import default_corpus
from test_finetune import assert_quiet_console
from test_shipped_tokenizers import sentence_transformers_dir, text_words

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Walked after the README, in this order: their fenced blocks' commands are run too (indented
# blocks are records of measurements, not run).
WALKED_DOCS = ["docs/finetuning.md", "docs/probing-and-ablations.md", "docs/interop.md"]
# Commands for other models or machines, each tested elsewhere or needing what CI lacks.
NOT_HERE = {
    "configs/base.py": "BERT-base pretraining on your corpus (tests/test_train.py: the same code)",
}
# Appended to the README's command per module: small step counts, nothing else changed.
SMALL = {
    "bertjax.train": [
        "--config.train.total_steps=6",
        "--config.optimizer.warmup_steps=1",
        "--config.train.log_every=3",
        "--config.train.eval_every=0",
        "--config.train.checkpoint_every=3",
        "--config.train.eval_batches=2",
        "--config.train.global_batch_size=8",
        "--config.data.dupe_factor=1",
    ],
    "bertjax.finetune": [
        "--config.num_train_epochs=1",
        "--config.max_seq_length=64",
        "--config.train_batch_size=8",
        "--config.eval_batch_size=8",
    ],
    "squad.py": ["--config.doc_stride=32", "--config.max_query_length=16"],
    "bertjax.extract_features": ["--max_seq_length=32"],
    "bertjax.probe": ["--seeds=1", "--epochs=1", "--max_seq_length=32"],
}


def walked_text() -> str:
    """The README, then the WALKED_DOCS, as one text."""
    texts = []
    for name in ["README.md", *WALKED_DOCS]:
        with open(os.path.join(REPO_ROOT, name), encoding="utf-8") as f:
            texts.append(f.read())
    return "\n".join(texts)


def readme_commands() -> list[str]:
    """The shell commands of the walked files' fenced code blocks, continuation lines joined,
    comments and `pip install ... &&` prefixes dropped, in order."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```", walked_text(), re.MULTILINE | re.DOTALL)
    commands = []
    for language, block in blocks:
        if language:  # ```python: the snippet, run on its own
            continue
        for raw in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", raw.split("&& ")[-1]).strip()
            if line.startswith("python -m bertjax"):
                commands.append(re.sub(r"\s+", " ", line))
    return commands


def python_snippet() -> str:
    (snippet,) = re.findall(r"^```python\n(.*?)^```", walked_text(), re.MULTILINE | re.DOTALL)
    return snippet


def task_files(root) -> None:
    """Small GLUE MRPC and SST-2, CoNLL-2003 and SQuAD v1.1 files (sentences of the default corpus),
    the extraction input, in the README's names."""
    rng = random.Random(0)
    sentences = [s for d in default_corpus.default_corpus() for s in d if 30 < len(s) < 120]
    sentences = sentences[:400]
    os.makedirs(root / "glue_data" / "MRPC")
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String"
    for split, count in (("train", 48), ("dev", 16), ("test", 8)):
        rows = []
        for i in range(count):
            a = rng.choice(sentences)
            b = (
                " ".join(w for w in a.split() if rng.random() > 0.2)
                if i % 2
                else rng.choice(sentences)
            )
            rows.append(f"{i if split == 'test' else i % 2}\t{i}\t{i + 1}\t{a}\t{b}")
        (root / "glue_data" / "MRPC" / f"{split}.tsv").write_text(
            "\n".join([header.replace("Quality", "index") if split == "test" else header, *rows])
            + "\n"
        )
    os.makedirs(root / "glue_data" / "SST-2")
    for split, count in (("train", 32), ("dev", 16), ("test", 8)):
        rows = [
            f"{i}\t{rng.choice(sentences)}"
            if split == "test"
            else f"{rng.choice(sentences)}\t{i % 2}"
            for i in range(count)
        ]
        (root / "glue_data" / "SST-2" / f"{split}.tsv").write_text(
            "\n".join(["index\tsentence" if split == "test" else "sentence\tlabel", *rows]) + "\n"
        )
    os.makedirs(root / "conll2003")
    for split in ("train.txt", "valid.txt", "test.txt"):
        lines = ["-DOCSTART- -X- -X- O", ""]
        for _ in range(16):
            name, place = rng.choice(["John", "Mary", "Guido"]), rng.choice(["Paris", "Oslo"])
            lines += [
                f"{name} NNP B-NP B-PER",
                "lives VBZ B-VP O",
                "in IN B-PP O",
                f"{place} NNP B-NP B-LOC",
                ". . O O",
                "",
            ]
        (root / "conll2003" / split).write_text("\n".join(lines) + "\n")
    paragraphs = []
    for i in range(16):
        context = " ".join(rng.sample(sentences, 3))
        answer = context.split()[5]
        paragraphs.append(
            {
                "context": context,
                "qas": [
                    {
                        "id": f"q{i}",
                        "question": f"what is the sixth word of {context.split()[0]}?",
                        "answers": [{"text": answer, "answer_start": context.index(answer)}],
                    }
                ],
            }
        )
    for name in ("train-v1.1.json", "dev-v1.1.json"):
        (root / name).write_text(
            json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]})
        )
    (root / "in.txt").write_text("The quick brown fox.\nA sentence ||| and its pair.\n")


@pytest.mark.parity
def test_readme_commands_run_top_to_bottom(tmp_path):
    transformers = pytest.importorskip("transformers")
    task_files(tmp_path)
    # interop.md's sentence-transformers directory as shipped (test_shipped_tokenizers.py).
    sentence_transformers_dir(
        tmp_path / "all-MiniLM-L6-v2",
        text_words([s for d in default_corpus.default_corpus() for s in d][:400]),
    )
    env = {
        **os.environ,
        "PYTHONPATH": REPO_ROOT,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    }
    ran = []
    for number, command in enumerate(readme_commands()):
        skipped = [why for what, why in NOT_HERE.items() if what in command]
        if skipped:
            continue
        words = (
            command.replace("PRETRAIN_WORKDIR", "workdir/tiny")
            .replace("--workdir=DIR", f"--workdir=out_{number}")
            .split()
        )
        assert words[:2] == ["python", "-m"], command
        if words[2:4] == ["bertjax.convert", "uncased_L-12_H-768_A-12"]:
            # Google's download stands in: the TF checkpoint the previous command wrote.
            shutil.copytree(tmp_path / "tiny_tf", tmp_path / "uncased_L-12_H-768_A-12")
        words = [w.replace("--config=configs/", f"--config={REPO_ROOT}/configs/") for w in words]
        small = [flag for key, flags in SMALL.items() if key in command for flag in flags]
        result = subprocess.run(
            [sys.executable, *words[1:], *small],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-3000:])
        assert_quiet_console(result.stdout + result.stderr)
        ran.append(words[2])
    assert ran == [
        "bertjax.train",
        "bertjax.finetune",
        "bertjax.extract_features",
        "bertjax.convert",  # the README's three jobs
        "bertjax.finetune",
        "bertjax.finetune",
        "bertjax.finetune",  # finetuning.md
        "bertjax.probe",  # probing-and-ablations.md
        "bertjax.finetune",
        "bertjax.extract_features",  # interop.md: as shipped
        "bertjax.convert",
        "bertjax.convert",
    ], ran
    assert (
        json.loads((tmp_path / "workdir" / "tiny" / "final_metrics.json").read_text())["step"] == 6
    )
    record = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert [layer["index"] for layer in record["features"][0]["layers"]] == [-1, -2]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tiny_hf"))
    assert tokenizer("The quick brown fox.")["input_ids"][0] == tokenizer.cls_token_id
    assert_loads_completely(transformers, tmp_path / "tiny_hf")
    snippet = subprocess.run(
        [sys.executable, "-c", python_snippet()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert snippet.returncode == 0, snippet.stderr[-3000:]
    assert_loads_completely(transformers, tmp_path / "out")


def assert_loads_completely(transformers, directory) -> None:
    """transformers loads every weight of BertForPreTraining from the export: none missing
    (left at random init), none unexpected, none of another shape."""
    _, info = transformers.BertForPreTraining.from_pretrained(
        str(directory), output_loading_info=True
    )
    problems = {key: value for key, value in info.items() if value}
    assert problems == {}, problems


# A path of one particular machine: a workspace, home, root or scratch directory.
MACHINE_PATH = re.compile(r"/work/|/home/|/root/|/tmp/[a-z]")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def doc_files() -> list[str]:
    return ["README.md", *sorted(glob.glob("docs/*.md", root_dir=REPO_ROOT))]


def anchors(path: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces
    as hyphens."""
    with open(path, encoding="utf-8") as f:
        headings = re.findall(r"^#+ (.+)$", f.read(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_a_front_door():
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) < 200
    assert "## Where to read on" in text
    listed = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", text.split("## Where to read on")[1]))
    unlisted = set(glob.glob("docs/*.md", root_dir=REPO_ROOT)) - listed
    assert unlisted == set(), "docs missing from the README's contents list"


def test_every_link_of_the_readme_and_docs_resolves():
    """Relative links (and their #anchors) of README.md and docs/*.md name files that exist."""
    broken = []
    for name in doc_files():
        with open(os.path.join(REPO_ROOT, name), encoding="utf-8") as f:
            links = LINK.findall(f.read())
        for link in links:
            if "://" in link or link.startswith("mailto:"):
                continue
            target, _, anchor = link.partition("#")
            path = (
                os.path.normpath(os.path.join(REPO_ROOT, os.path.dirname(name), target))
                if target
                else os.path.join(REPO_ROOT, name)
            )
            if not os.path.exists(path):
                broken.append(f"{name}: {link} (no such file)")
            elif anchor and path.endswith(".md") and anchor not in anchors(path):
                broken.append(f"{name}: {link} (no such heading)")
    assert broken == []


def test_no_machine_specific_paths_in_readme_docs_or_benchmarks():
    """Commands and records use placeholders ($DATA, DIR, ...), never one machine's paths."""
    found = []
    for root in ("README.md", "docs", "benchmarks"):
        paths = (
            [root]
            if os.path.isfile(os.path.join(REPO_ROOT, root))
            else sorted(glob.glob(f"{root}/**/*", root_dir=REPO_ROOT, recursive=True))
        )
        for path in paths:
            full = os.path.join(REPO_ROOT, path)
            if not os.path.isfile(full):
                continue
            with open(full, "rb") as f:
                data = f.read()
            if b"\0" in data[:4096]:  # binary (images)
                continue
            for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                if MACHINE_PATH.search(line):
                    found.append(f"{path}:{number}: {line.strip()[:120]}")
    assert found == []


def test_ci_runs_the_readme_test_command_first_each_stage_in_a_fresh_environment():
    """.ci/run's first stage is the README's test command verbatim; it and every later stage
    run in a virtual environment made from nothing (no package left on a machine can stand in
    for a missing install step); the script is shellcheck-clean."""
    from test_launch import shellcheck_binary

    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        quick_start = re.search(r"## Quick start\n\n```\n(.*?)```", f.read(), re.DOTALL).group(1)
    install_and_run, test_command = quick_start.strip().splitlines()
    assert install_and_run.startswith("pip install -e . && python -m bertjax.train")
    script = os.path.join(REPO_ROOT, ".ci", "run")
    with open(script, encoding="utf-8") as f:
        text = f.read()
    assert 'python3 -m venv "${ENVS}/${name}"' in text
    assert 'PATH="${ENVS}/${name}/bin:${PATH}"' in text
    stages = re.findall(r'^in_fresh_env (\w+) "(.*)"$', text, re.MULTILINE)
    assert stages[0] == ("test", test_command)
    assert [name for name, _ in stages] == ["test", "slow", "gcs", "parity", "aot", "beam", "lint"]
    assert all(command.startswith("pip install ") for _, command in stages)
    commands = [line for line in text.splitlines() if line and not line.startswith(("#", " "))]
    assert not [
        line
        for line in commands
        if re.search(r"\bpip\b", line) and not line.startswith("in_fresh_env")
    ]
    result = subprocess.run(
        [shellcheck_binary(), script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout
