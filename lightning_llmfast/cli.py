"""``LightningCLI`` with hints for misspelt model flags and one-line configuration errors.

``--model.num_layers`` (the flag a user tries first) is not an option of the reference module; the error then
names ``--model.config.n_layers``. A configuration that our checks reject (``n_layers: 0``) ends the run with one
line naming the field and the rule instead of a traceback.

Example::

    from lightning_llmfast.cli import LLMFastCLI
    from lightning_llmfast import MoEGPTLightningModule, PackedDataModule

    LLMFastCLI(MoEGPTLightningModule, PackedDataModule)  # python train.py fit --model.config.n_layers 8 ...
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import itertools
import sys
import typing
from collections.abc import Sequence
from typing import Any

import yaml  # jsonargparse's own dependency
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_llmfast.errors import LLMFastError

__all__ = ["ALIASES", "LLMFastCLI", "flag_hints"]

ALIASES: dict[str, tuple[str, ...]] = {
    "n_layers": ("num_layers", "num_hidden_layers", "n_layer", "layers", "depth"),
    "n_heads": ("num_heads", "num_attention_heads", "n_head", "heads"),
    "n_kv_heads": ("num_kv_heads", "num_key_value_heads", "n_kv_head", "kv_heads"),
    "hidden_size": ("hidden_dim", "d_model", "dim", "n_embd", "width", "embed_dim"),
    "ffn_size": ("intermediate_size", "ffn_dim", "d_ff", "moe_intermediate_size", "ffn_hidden_size"),
    "num_experts": ("num_local_experts", "n_experts", "n_routed_experts", "experts"),
    "top_k": ("num_experts_per_tok", "experts_per_token", "k", "moe_top_k"),
    "vocab_size": ("vocab", "n_vocab"),
}
"""Field name -> names other libraries (transformers, nanoGPT, Megatron) use for it; the hints map them back."""


def _options(module_class: Any) -> dict[str, str]:
    """Every ``--model.*`` key of ``module_class`` (``"lr"``, ``"config.n_layers"``), mapped to its field name."""
    options: dict[str, str] = {}
    try:
        hints = typing.get_type_hints(module_class.__init__)
    except Exception:  # unresolvable annotations: fall back to the names alone
        hints = {}
    for name in inspect.signature(module_class.__init__).parameters:
        if name in ("self", "args", "kwargs"):
            continue
        options[name] = name
        kind = hints.get(name)
        for candidate in (kind, *typing.get_args(kind)):
            if dataclasses.is_dataclass(candidate):
                options.update({f"{name}.{f.name}": f.name for f in dataclasses.fields(candidate)})
    return options


def flag_hints(args: Sequence[str], module_class: Any, prefix: str = "model") -> list[str]:
    """Hints for the ``--{prefix}.*`` flags in ``args`` that ``module_class`` does not take.

    A flag is matched against the module's arguments and the fields of its dataclass arguments: first through
    :data:`ALIASES` (``num_layers`` -> ``n_layers``), then by spelling (``n_layer`` -> ``n_layers``).

    Returns:
        One line per unknown flag, e.g.
        ``"--model.num_layers is not an option; did you mean --model.config.n_layers?"``.

    Example::

        flag_hints(["fit", "--model.num_layers", "8"], MoEGPTLightningModule)
    """
    options = _options(module_class)
    by_field: dict[str, list[str]] = {}
    for key, name in options.items():
        by_field.setdefault(name, []).append(key)
    hints = []
    for arg in args:
        if not arg.startswith(f"--{prefix}."):
            continue
        key = arg[len(prefix) + 3 :].partition("=")[0]
        if key in options or key == "help" or key.endswith(".help"):
            continue
        leaf = key.rpartition(".")[2]
        aliased = [field for field, names in ALIASES.items() if leaf in names and field in by_field]
        close = aliased or difflib.get_close_matches(leaf, list(by_field), n=1, cutoff=0.75)
        if close:
            suggestion = " or ".join(f"--{prefix}.{option}" for option in by_field[close[0]])
            hints.append(f"--{prefix}.{key} is not an option; did you mean {suggestion}?")
        else:
            hints.append(f"--{prefix}.{key} is not an option; see the {prefix} section of --help")
    return hints


def _config_file_flags(args: Sequence[str], prefix: str) -> list[str]:
    """The ``{prefix}.*`` keys of the YAML files passed with ``--config``, written as flags (for :func:`flag_hints`)."""
    paths = [b for a, b in itertools.pairwise(args) if a == "--config"]
    paths += [a.partition("=")[2] for a in args if a.startswith("--config=")]
    flags: list[str] = []
    for path in paths:
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f)
        except (OSError, yaml.YAMLError):
            continue  # the parser reports an unreadable file itself
        section = loaded.get(prefix) if isinstance(loaded, dict) else None
        if isinstance(section, dict):
            flags += [f"--{prefix}.{key}" for key, _ in _flatten_keys(section)]
    return flags


def _flatten_keys(section: dict[str, Any], stem: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in section.items():
        if isinstance(value, dict) and key not in ("init_args", "dict_kwargs"):
            out += _flatten_keys(value, f"{stem}{key}.")
        else:
            out.append((f"{stem}{key}", value))
    return out


class LLMFastCLI(LightningCLI):
    """A ``LightningCLI`` whose errors help: misspelt ``--model.*`` flags (or ``model:`` keys of a ``--config``
    file) get a hint naming the right flag, and an
    error of ours raised while building the model, data or trainer (a :class:`~lightning_llmfast.errors.ConfigError`
    such as ``MoEGPTConfig.n_layers must be an int >= 1, got 0``) ends the run with that one line and exit status 2.

    Takes the arguments of ``LightningCLI``.

    Example::

        LLMFastCLI(MoEGPTLightningModule, PackedDataModule, save_config_kwargs={"overwrite": True})
    """

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except SystemExit:
            argv = list(args) if isinstance(args, (list, tuple)) else sys.argv[1:]
            flags = [*argv, *_config_file_flags(argv, "model")]
            for hint in flag_hints(flags, self.model_class) if self.model_class is not None else []:
                print(f"hint: {hint}", file=sys.stderr)
            raise

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except LLMFastError as err:
            message = str(err).splitlines()[0] if str(err) else type(err).__name__
            print(f"error: {type(err).__name__}: {message}", file=sys.stderr)
            raise SystemExit(2) from None
