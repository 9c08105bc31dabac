"""``Job(...)``'s keywords as job-file keys: loomrl's shortcuts, any key by its dotted name or
its own unique name, whole sections as dicts, and TRL ``GRPOTrainer`` / ``GRPOConfig`` names
(``loomrl.config_hints``, the map the job file's hints use); function objects, in-memory
datasets and model objects become what a job file holds (import paths, folders).

    Job(model="tiny:llama", dataset=ds, reward_funcs=[f, g], reward_weights=[1, 0.2],
        num_generations=8, max_completion_length=256, learning_rate=1e-6, beta=0.0)
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from loomrl.config import ConfigError, JobConfig, key_paths
from loomrl.config_hints import TRL_KEYS, TRL_NAMES, TRL_NOTES, TRL_VALUES, suggest
from loomrl.data_sources import materialize
from loomrl.scoring.calls import callable_path

# loomrl's keyword shortcuts of ``Job(...)`` and the keys they set.
SHORTCUTS = {
    "model": "model.path",
    "dataset": "data.train",
    "eval_dataset": "data.eval",
    "reward": "task.reward",
    "rewards": "task.rewards",
    "environment": "task.environment",
    "group_size": "algorithm.group_size",
    "groups_per_step": "algorithm.groups_per_step",
    "max_staleness": "algorithm.max_staleness",
    "loss": "algorithm.loss",
    "lr": "trainer.lr",
    "num_steps": "trainer.num_steps",
}
# Keywords about the reward list and the model's tokenizer, read together with others.
_LIST_WORDS = ("reward_funcs", "reward_weights", "processing_class", "tokenizer")


def base_raw(config: JobConfig | str | Path | dict | None) -> tuple[dict[str, Any], str]:
    """The job ``Job(config, ...)`` starts from, as a dict, and its name for messages."""
    if config is None:
        return {}, "Job(...)"
    if isinstance(config, JobConfig):
        return config.dump(), "Job(JobConfig, ...)"
    if isinstance(config, dict):
        return dict(config), "Job(dict, ...)"
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"Job({str(config)!r}): job file not found")
        try:
            return tomllib.loads(path.read_text()), f"Job({str(path)!r}, ...)"
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    raise TypeError(
        f"Job's first argument is a JobConfig, a job file's path or a dict, not {type(config).__name__}"
    )


def apply_keywords(raw: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with each keyword set (module docstring); an unknown one is a TypeError with
    the job file's hint (a TRL name's loomrl key, or the closest key)."""
    kwargs = dict(kwargs)
    for word in ("dataset", "eval_dataset", "train_dataset"):
        if kwargs.get(word) is not None:
            kwargs[word] = materialize(kwargs[word], word)
    if "model" in kwargs or "model_name_or_path" in kwargs:
        word = "model" if "model" in kwargs else "model_name_or_path"
        tokenizer = kwargs.pop("processing_class", None) or kwargs.pop("tokenizer", None)
        kwargs[word] = model_path(kwargs[word], tokenizer)
    elif kwargs.get("processing_class") is not None or kwargs.get("tokenizer") is not None:
        raise TypeError(
            "processing_class= (the tokenizer) goes with a model object given as model="
        )
    rewards = reward_list(kwargs)
    if rewards is not None:
        _replace_reward(raw, "rewards", rewards)
    if "reward" in kwargs:
        reward = kwargs["reward"]
        _replace_reward(raw, "reward", callable_path(reward) if callable(reward) else reward)
    for word, value in kwargs.items():
        if word not in (*_LIST_WORDS, "rewards", "reward"):
            _set_keyword(raw, word, value)
    return raw


def _replace_reward(raw: dict[str, Any], key: str, value: Any) -> None:
    """A reward given by keyword replaces the base's, whatever its form: ``task.reward``,
    ``[[task.rewards]]`` or a ``[task.scorer]`` table."""
    task = raw.get("task") if isinstance(raw.get("task"), dict) else {}
    others = {"reward": None, "rewards": [], "scorer": None}
    raw["task"] = {**task, **{k: v for k, v in others.items() if k in task}, key: value}


def translated(kwargs: dict[str, Any]) -> str:
    """The TRL names among ``kwargs`` and their loomrl keys, for a config error's source."""
    names = [
        f"{word}={TRL_KEYS.get(word, TRL_NOTES.get(word))}"
        for word in kwargs
        if word not in SHORTCUTS and (word in TRL_KEYS or word in TRL_VALUES)
    ]
    return f"; TRL's {', '.join(names)}" if names else ""


def _set_keyword(raw: dict[str, Any], word: str, value: Any) -> None:
    sections = JobConfig.model_fields
    if word in SHORTCUTS:
        _set(raw, SHORTCUTS[word], value)
    elif word in sections:
        current = raw.get(word)
        merge = isinstance(value, dict) and isinstance(current, dict)
        raw[word] = {**current, **value} if merge else value
    elif "." in word:
        if word not in key_paths() and word.partition(".")[0] not in sections:
            raise TypeError(
                f"Job({word}=...): unknown key ({suggest(word, key_paths()) or 'see `loomrl config`'})"
            )
        _set(raw, word, value)
    elif word in TRL_KEYS:
        _set(raw, TRL_KEYS[word], value)
    elif word in TRL_VALUES:
        for key, converted in TRL_VALUES[word](value, raw).items():
            _set(raw, key, converted)
    elif word in unique_leaves():
        _set(raw, unique_leaves()[word], value)
    else:
        raise TypeError(_unknown(word))


def _unknown(word: str) -> str:
    if word in TRL_NAMES:
        return f"Job({word}=...): TRL's {word!r} has no loomrl keyword; write {TRL_NAMES[word]}"
    paths = key_paths()
    several = [p for p in paths if p.rpartition(".")[2] == word]
    if len(several) > 1:
        return f"Job({word}=...): several keys are named {word!r} ({', '.join(several)}); give the dotted one as **{{'{several[0]}': ...}}"
    hint = suggest(word, [*paths, *SHORTCUTS, *TRL_KEYS, *TRL_VALUES])
    return f"Job({word}=...): unknown keyword ({hint or 'check the spelling'}; `loomrl config` lists every key)"


@cache
def unique_leaves() -> dict[str, str]:
    """Each key's last name that no other key shares (``max_new_tokens``), and the key;
    keys inside a list of tables (``[[task.rewards]]``) are left out."""
    by_leaf: dict[str, list[str]] = {}
    for path in key_paths():
        if not path.startswith("task.rewards."):
            by_leaf.setdefault(path.rpartition(".")[2], []).append(path)
    return {leaf: paths[0] for leaf, paths in by_leaf.items() if len(paths) == 1}


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    *parents, last = dotted.split(".")
    for part in parents:
        child = node.get(part)
        if isinstance(child, str):
            # a tagged table given by its type alone (engine = "hf")
            child = {"type": child}
        elif not isinstance(child, dict):
            child = {}
        node[part] = child
        node = child
    node[last] = value


def reward_list(kwargs: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``rewards=`` or TRL's ``reward_funcs=`` (functions, import paths, spec dicts), with
    ``reward_weights=``, as ``[[task.rewards]]`` tables; None when neither was given."""
    funcs = kwargs.get("rewards", kwargs.get("reward_funcs"))
    weights = kwargs.get("reward_weights")
    if "rewards" in kwargs and "reward_funcs" in kwargs:
        raise TypeError("give the rewards once: rewards= or TRL's reward_funcs=, not both")
    if funcs is None:
        if weights is not None:
            raise TypeError("reward_weights= weighs the functions of rewards= (or reward_funcs=)")
        return None
    if callable(funcs) or isinstance(funcs, (str, dict)):
        funcs = [funcs]
    specs = [_reward_spec(item, f"rewards[{n}]") for n, item in enumerate(funcs)]
    if weights is not None:
        if len(weights) != len(specs):
            raise ValueError(
                f"reward_weights has {len(weights)} weights for {len(specs)} reward functions"
            )
        for spec, weight in zip(specs, weights):
            spec["weight"] = float(weight)
    _unique_names(specs)
    return specs


def _reward_spec(item: Any, where: str) -> dict[str, Any]:
    if isinstance(item, dict):
        spec = dict(item)
        if callable(spec.get("path")):
            spec.setdefault("name", _function_name(spec["path"]))
            spec["path"] = callable_path(spec["path"])
        return spec
    if isinstance(item, str):
        return {"path": item}
    if callable(item):
        return {"path": callable_path(item), "name": _function_name(item)}
    raise TypeError(
        f"{where} is a {type(item).__name__}: give a reward function, its import path "
        "'module:function', or a dict such as {'path': fn, 'weight': 0.5, 'name': 'format'}"
    )


def _function_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", "") or "reward"
    return name if name.isidentifier() else "reward"


def _unique_names(specs: list[dict[str, Any]]) -> None:
    """Two parts of one name (two lambdas) as ``name`` and ``name_2``: each has its metric."""
    seen: dict[str, int] = {}
    for spec in specs:
        name = spec.get("name")
        if name is None:
            continue
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            spec["name"] = f"{name}_{seen[name]}"


def model_path(model: Any, tokenizer: Any = None) -> str:
    """``model=`` as a path: a str or Path as it is; a transformers model object (with its
    tokenizer as ``processing_class=``) saved once to a folder named by its content."""
    if isinstance(model, (str, Path)):
        if tokenizer is not None:
            raise TypeError(
                "processing_class= goes with a model object; a model folder holds its own tokenizer"
            )
        return str(model)
    from loomrl.models.saved import save_model_object

    return save_model_object(model, tokenizer)
