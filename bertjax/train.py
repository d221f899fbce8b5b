"""`python -m bertjax.train --config=configs/large.py --workdir=DIR`: BERT pretraining.

Any config field can be overridden on the command line, e.g. `--config.train.total_steps=100`.
Running the same command again resumes from the latest checkpoint in DIR.
"""

from __future__ import annotations

import sys
from collections.abc import Collection

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from bertjax import cli
from bertjax.errors import ConfigError, UserError
from bertjax.runtime import console, distributed, failures, peers, stopping
from bertjax.training import (
    pretrain_run,
    validate,
)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    devices: list[jax.Device] | None = None,
    overrides: Collection[str] = (),
) -> dict[str, float]:
    """Pretrains (or resumes) in `workdir`, which no other run may use meanwhile (a lock);
    returns the final evaluation metrics. `devices` defaults to all devices; the mesh in
    `config.mesh` must cover them exactly. The model of a run from `train.init_checkpoint`
    is the checkpoint's (`init_architecture.model_of_init_checkpoint`); `overrides` (the
    dotted fields set on the command line) must agree with it."""
    if not workdir.strip():
        raise ConfigError("--workdir is empty: name the directory of the run")
    settings = validate.sections(config)  # (typed, built once: the model is the run's)
    return pretrain_run.PretrainingRun(settings, config.to_json(), workdir, devices).train(
        overrides
    )


FLAGS = flags.FLAGS


def define_flags() -> None:
    """Command-line flags; defined only when run as a program, so importing is side-effect free."""
    config_flags.DEFINE_config_file(
        "config", None, "Config file with get_config().", lock_config=True
    )
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, TensorBoard and data cache.")
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "host:port of process 0 (multi-process "
        "runs off TPU VMs); default: $JAX_COORDINATOR_ADDRESS or auto-detection.",
    )
    flags.DEFINE_integer(
        "num_processes", None, "Processes in the job (with --coordinator_address)."
    )
    flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")
    flags.DEFINE_integer(
        "heartbeat_timeout_seconds",
        None,
        "Seconds without a heartbeat after "
        "which the processes of a multi-process job give up on a lost peer and "
        "exit; default: JAX's (100).",
    )
    flags.DEFINE_integer(
        "join_timeout_seconds",
        None,
        "Seconds every process waits for all "
        "to join the job; then those that joined exit 75 naming the ones that "
        f"did not; default: {peers.JOIN_TIMEOUT_SECONDS}.",
    )
    flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    del argv
    failures.one_line_thread_errors()
    overrides = config_flags.get_override_values(FLAGS["config"]).keys()
    try:
        # A flag error: the same line on every host, unjoined (the model the run takes is
        # told later: no JAX backend yet).
        settings = validate.sections(FLAGS.config)
        pretrain_run.PretrainingRun(settings, FLAGS.config.to_json(), FLAGS.workdir).resolved(
            overrides, tell=False
        )
        distributed.initialize(
            FLAGS.coordinator_address,
            FLAGS.num_processes,
            FLAGS.process_id,
            FLAGS.heartbeat_timeout_seconds,
            FLAGS.join_timeout_seconds,
        )
        stopping.take_sigterm()  # (JAX's preemption notice, seen also while stuck)
        peers.watch(console.log_file(FLAGS.workdir), FLAGS.heartbeat_timeout_seconds)
        train_and_evaluate(FLAGS.config, FLAGS.workdir, overrides=overrides)
    except failures.Stopped as e:  # (its last line said so)
        sys.exit(e.status)
    except KeyboardInterrupt:
        cli.leave(
            "interrupted (Ctrl-C) outside the training steps; nothing to save (rerun to "
            "resume from the last checkpoint)",
            130,
            at_once=True,
        )
    except (UserError, OSError) as e:
        peers.announce_failure(e)  # (peers waiting for this process stop too)
        cli.leave_on(e, FLAGS.workdir)
    except jax.errors.JaxRuntimeError as e:  # a collective failed: a peer lost?
        peers.leave_if_peer_lost(e)
        raise
    except Exception as e:  # a bug: in a multi-process run the others stop too
        peers.leave_on_bug(e)
        raise


if __name__ == "__main__":
    define_flags()
    cli.run(main)
