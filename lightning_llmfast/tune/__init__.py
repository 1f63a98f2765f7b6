"""``python -m lightning_llmfast.tune``: search the training settings by short trials and write the fastest config.

The search takes an example-CLI config (``examples/train_moe.py fit --config CFG.yaml``) and a space: the CLI's
dotted keys (``data.batch_size``, ``model.config.router_backend``, ``trainer.strategy.init_args.offload`` ...) mapped
to lists of values (``--space SPACE.yaml``, or :func:`default_space` from the config and the world). Every candidate
keeps the optimizer's batch (``--global-batch`` sequences per optimizer step: ``trainer.accumulate_grad_batches`` is
set per candidate, and one that cannot reach it is pruned; so is one the strategy would refuse: a pipeline layout it
cannot run on the world, the model's layers or the micro-batch), gets a predicted peak memory per device
(:func:`predict_memory`: the sharding plan's parameter, gradient and AdamW bytes plus the saved activations the memory
plan predicts from a measured probe; under pipelining those of the most loaded stage and its microbatches in flight)
and, with ``--memory-budget``, is pruned when predicted over it. The others run
the example CLI, each in a process of its own forked from a server that imported torch and Lightning once (a crash,
an OOM or a hang ends one trial; each has a timeout), and log ``train/tokens_per_sec`` and the peak memory through
the package's monitors and a CSV logger; warm-up steps are left out and the trial's rate is the median of the rest.
Successive halving runs every candidate ``--steps`` steps, then the best ``1/eta`` of them ``eta`` times longer, while
more than one goes on, within ``--time-budget`` seconds (a trial running at the deadline is stopped and not recorded).
A trial's process group ends with it on every exit, and every process the search started ends within seconds of the
tuner, a ``kill -9`` included (:mod:`lightning_llmfast.tune.runner`); Ctrl-C stops the running trial and exits with
status 130. While it searches, ``tune`` says one line per trial on stderr (settings, status, tokens/s, predicted and
peak memory, time used of the budget), under a progress bar of the rung's trials when stderr is a terminal.

Written to ``DIR``: ``trials.jsonl`` (one JSON object a trial: :data:`RECORD_FIELDS`, its measured steps and rung
among them; appended and fsynced line by line, so rerunning the same command after a kill continues the search
without repeating a finished trial), ``best.yaml`` (the config with the fastest trial's settings, trainable as it
is), ``report.md`` (every trial, best first, with the error of the memory prediction) and ``report.png`` (tokens/s
against peak memory, the pruned apart; needs the ``plot`` extra, matplotlib). Errors print one line, ``error: ...``,
and exit with status 2. ``--memory-budget`` takes bytes or a size with a unit (``80GiB``, ``500MB``:
:func:`parse_bytes`).

The package, by concept: :mod:`~lightning_llmfast.tune.config` (what a search is), :mod:`~.records` (what it
records), :mod:`~.space` (the settings and the space), :mod:`~.memory` (the memory prediction), :mod:`~.runner`
(trials as processes), :mod:`~.search` (pruning and successive halving), :mod:`~.report` (what it says and writes),
:mod:`~.cli` (the command line).

Example::

    python -m lightning_llmfast.tune --config examples/configs/tiny.yaml --out tuned/ --global-batch 16 \\
        --time-budget 600 --steps 4

    result = tune(TuneConfig("examples/configs/tiny.yaml", "tuned/", space={"data.batch_size": [4, 8, 16]}))
    result.best.settings  # {"data.batch_size": 16, "trainer.accumulate_grad_batches": 1}
"""

from lightning_llmfast.tune.cli import main
from lightning_llmfast.tune.config import TuneConfig, parse_bytes
from lightning_llmfast.tune.memory import REFERENCE_MODULE, predict_memory
from lightning_llmfast.tune.records import (
    RECORD_FIELDS,
    STATUSES,
    Measurement,
    Trial,
    TrialLog,
    TrialRecord,
    TrialRunner,
    TuneResult,
)
from lightning_llmfast.tune.report import Progress, trial_line, write_plot, write_report
from lightning_llmfast.tune.runner import PRELOAD, SubprocessRunner, read_metrics, trial_config
from lightning_llmfast.tune.search import tune
from lightning_llmfast.tune.space import (
    ACCUMULATE,
    MICRO_BATCH,
    STRATEGY_CLASS,
    apply_settings,
    default_space,
    load_space,
)

__all__ = [
    "ACCUMULATE",
    "MICRO_BATCH",
    "PRELOAD",
    "RECORD_FIELDS",
    "REFERENCE_MODULE",
    "STATUSES",
    "STRATEGY_CLASS",
    "Measurement",
    "Progress",
    "SubprocessRunner",
    "Trial",
    "TrialLog",
    "TrialRecord",
    "TrialRunner",
    "TuneConfig",
    "TuneResult",
    "apply_settings",
    "default_space",
    "load_space",
    "main",
    "parse_bytes",
    "predict_memory",
    "read_metrics",
    "trial_config",
    "trial_line",
    "tune",
    "write_plot",
    "write_report",
]
