"""Mutation check: plants deliberate bugs in a copy of the repository and shows that the
tests meant to catch each one fail.

    python tests/mutation_check.py [--only NAME] [--out benchmarks/mutation_check.md]

Each mutation replaces one exact string in one source file (the script stops with an error
if the string is not found exactly once, so a refactoring cannot silently turn a mutation
into a no-op), then runs the named tests with PYTHONPATH pointing at the copy. A mutation is
caught when pytest reports failed tests (exit code 1); a collection or usage error (exit
codes 2-4) counts as an error of this script, not as a catch. First, the same tests run on
the unmutated copy and must pass, so every failure below is the planted bug's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "dropout on in eval",
        "bertjax/training/steps.py",
        "forward(model, params, batch, True, causal=objective.causal)",
        "forward(model, params, batch, False, jax.random.PRNGKey(0), causal=objective.causal)",
        ("tests/test_steps.py::test_eval_is_deterministic_with_dropout_and_matches_numpy",),
    ),
    Mutation(
        "MLM loss without its weights",
        "bertjax/models/layers/losses.py",
        "loss_sum = jnp.sum(weights_BxP * nll(logits_BxPxV",
        "loss_sum = jnp.sum(nll(logits_BxPxV",
        (
            "tests/test_steps.py::test_eval_is_deterministic_with_dropout_and_matches_numpy",
            "tests/test_packing.py::test_packed_rows_give_each_instance_its_own_logits_loss_"
            "and_gradient",
        ),
    ),
    Mutation(
        "NSP loss dropped",
        "bertjax/families/bert.py",
        "nsp_weight = 1.0 if next_sentence_prediction else 0.0",
        "nsp_weight = 0.0",
        ("tests/test_steps.py::test_eval_is_deterministic_with_dropout_and_matches_numpy",),
    ),
    Mutation(
        "resume from the oldest checkpoint, not the newest",
        "bertjax/training/resume.py",
        "for step in reversed(self.checkpointer.all_steps()):\n            sealed, problem",
        "for step in self.checkpointer.all_steps():\n            sealed, problem",
        ("tests/test_guards.py::test_a_change_can_be_accepted",),
    ),
    Mutation(
        "resume one batch late",
        "bertjax/training/pretrain_loop.py",
        "batch_index = position.batch_index  #",
        "batch_index = position.batch_index + 1  #",
        (
            "tests/test_guards.py::test_a_damaged_checkpoint_is_set_aside_and_the_previous_one_"
            "resumed[bit flip]",
        ),
    ),
    Mutation(
        "non-finite guard disabled",
        "bertjax/training/steps.py",
        "lambda new, old: jnp.where(gradients_finite, new, old)",
        "lambda new, old: new",
        (
            "tests/test_steps.py::test_non_finite_steps_are_skipped_and_their_cause_named",
            "tests/test_steps.py::test_non_finite_loss_and_non_finite_update_are_named",
        ),
    ),
    Mutation(
        "a non-finite state does not stop the run at once",
        "bertjax/training/nonfinite.py",
        "self.in_a_row >= self.max_in_a_row or found in (",
        "self.in_a_row >= self.max_in_a_row or found in (-1,) and (",
        (
            "tests/test_guards.py::test_host_stops_on_repeated_non_finite_steps_or_at_once_on_"
            "a_non_finite_state",
        ),
    ),
    Mutation(
        "fine-tuning saves a non-finite state",
        "bertjax/training/loop.py",
        "nonfinite.check_finite(state, step, ",
        "(lambda *_: None)(state, step, ",
        (
            "tests/test_finetune.py::test_an_overflowing_update_is_never_saved_and_skipped_"
            "steps_are_named",
        ),
    ),
    Mutation(
        "masked positions picked one off",
        "bertjax/models/layers/gather.py",
        "positions_BxP[:, :, None] == jnp.arange(x_BxLxH.shape[1])",
        "positions_BxP[:, :, None] == jnp.arange(x_BxLxH.shape[1]) + 1",
        ("tests/test_model.py::test_gathered_positions_and_their_gradient_equal_the_gather",),
    ),
    Mutation(
        "weight-decay mask inverted",
        "bertjax/training/param_masks.py",
        "lambda path, _: _is_decayed(path)",
        "lambda path, _: not _is_decayed(path)",
        ("tests/test_optim.py",),
    ),
    Mutation(
        "a failed write does not name its file",
        "bertjax/runtime/files.py",
        "raise OSError(e.errno, e.strerror, path) from e",
        "raise e",
        ("tests/test_faults.py::test_a_full_disk_while_preparing_data_is_one_line",),
    ),
    Mutation(
        "a resume ignores a changed short_seq_prob",
        "bertjax/training/guards.py",
        'DATA_FIELDS_NOT_COMPARED = (\n    "cache_dir",',
        'DATA_FIELDS_NOT_COMPARED = (\n    "short_seq_prob",\n    "cache_dir",',
        (
            "tests/test_guards.py::test_incompatible_resume_is_refused_before_preparation"
            "[short_seq_prob]",
        ),
    ),
    Mutation(
        "two dropout elements share a mask bit",
        "bertjax/models/dropout.py",
        "<< (2 * j + half)",
        "<< (2 * j)",
        ("tests/test_dropout.py",),
    ),
    Mutation(
        "the gradient ignores the dropout mask",
        "bertjax/models/dropout.py",
        "return apply_packed_mask(cotangent, packed, rate), None",
        "return cotangent, None",
        ("tests/test_dropout.py",),
    ),
    Mutation(
        "the GPU path drops the FFN's bias",
        "bertjax/models/bert/blocks.py",
        "self.activation(y + b))(y, bias)",
        "self.activation(y))(y, bias)",
        (
            "tests/test_model.py::test_the_gpu_targets_rematerialised_activation_changes_"
            "no_parameter_value_or_gradient",
        ),
    ),
    Mutation(
        "the BPE tokenizer's last merge rule dropped",
        "bertjax/data/bpe.py",
        "        self._hf = hf_json.library_tokenizer(self._text, path)",
        "        spec['model']['merges'] = spec['model']['merges'][:-1]\n"
        "        self._hf = hf_json.library_tokenizer(json.dumps(spec), path)",
        (
            "tests/test_shipped_tokenizers.py::test_bpe_and_wordpiece_ids_equal_the_"
            "tokenizers_library_over_a_text_file",
        ),
    ),
    Mutation(
        "a tokenizer.json's padding kept",
        "bertjax/data/hf_json.py",
        "    hf.no_padding()\n",
        "    pass  # (the padding kept)\n",
        (
            "tests/test_shipped_tokenizers.py::test_a_tokenizer_json_is_read_without_its_"
            "padding_and_truncation",
        ),
    ),
)


def copy_repository(target: str) -> None:
    shutil.copytree(
        REPO_ROOT,
        target,
        ignore=shutil.ignore_patterns(
            ".git", "__pycache__", ".pytest_cache", "*.egg-info", "build", "dist"
        ),
    )


def patch(root: str, mutation: Mutation, forward: bool = True) -> None:
    """Replaces `old` by `new` (or back); exits if the string is not there exactly once."""
    path = os.path.join(root, mutation.path)
    text = Path(path).read_text(encoding="utf-8")
    old, new = (mutation.old, mutation.new) if forward else (mutation.new, mutation.old)
    if text.count(old) != 1:
        sys.exit(
            f"error: mutation {mutation.name!r}: {mutation.path} holds {text.count(old)} "
            f"copies of {old!r}, not 1; update the mutation to the current source"
        )
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new))


def run_tests(root: str, tests: tuple[str, ...]) -> tuple[int, str, float]:
    """pytest on `tests` in the copy: (exit code, its summary line, seconds)."""
    env = {**os.environ, "PYTHONPATH": root}
    started = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [
        line for line in result.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", line)
    ]
    return (
        result.returncode,
        (lines[-1] if lines else result.stdout[-500:]).strip("= "),
        time.time() - started,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run only the mutation with this name")
    parser.add_argument("--out", help="also write the markdown record to this file")
    args = parser.parse_args()
    mutations = [m for m in MUTATIONS if args.only in (None, m.name)]
    if not mutations:
        sys.exit(f"error: no mutation named {args.only!r}")
    command = " ".join(["python", "tests/mutation_check.py", *sys.argv[1:]])
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} CPUs)",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="bertjax_mutants_") as tmp:
        root = os.path.join(tmp, "repo")
        copy_repository(root)
        imported = subprocess.run(
            [sys.executable, "-c", "import bertjax; print(bertjax.__file__)"],
            cwd=root,
            env={**os.environ, "PYTHONPATH": root},
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        if not imported.startswith(root):
            sys.exit(f"error: the copy imports bertjax from {imported}, not from {root}")
        for mutation in mutations:  # before any patch: every target string is there
            patch(root, mutation)
            patch(root, mutation, forward=False)
        everything = tuple(dict.fromkeys(t for m in mutations for t in m.tests))
        code, summary, seconds = run_tests(root, everything)
        print(f"baseline (no mutation): {summary} in {seconds:.0f} s", flush=True)
        if code != 0:
            sys.exit(f"error: the tests fail without any mutation ({summary}); fix them first")
        lines += [
            f"Baseline, unmutated copy: {summary} in {seconds:.0f} s.",
            "",
            "| mutation | file | tests run | result | seconds |",
            "| --- | --- | --- | --- | --- |",
        ]
        missed = []
        for mutation in mutations:
            patch(root, mutation)
            code, summary, seconds = run_tests(root, mutation.tests)
            patch(root, mutation, forward=False)
            if code not in (0, 1):
                sys.exit(
                    f"error: mutation {mutation.name!r}: pytest exit code {code} "
                    f"({summary}): not a test failure"
                )
            verdict = f"caught ({summary})" if code == 1 else f"MISSED ({summary})"
            if code == 0:
                missed.append(mutation.name)
            print(f"{mutation.name}: {verdict} in {seconds:.0f} s", flush=True)
            tests = "<br>".join(f"`{t.removeprefix('tests/')}`" for t in mutation.tests)
            lines.append(
                f"| {mutation.name} | `{mutation.path}` | {tests} | {verdict} | {seconds:.0f} |"
            )
    lines += ["", f"{len(mutations) - len(missed)} of {len(mutations)} mutations caught."]
    record = "\n".join(lines) + "\n"
    print(record)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("# Mutation check\n\n" + (__doc__ or "").split("\n\n", 1)[1] + "\n" + record)
    if missed:
        print(f"error: not caught: {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
