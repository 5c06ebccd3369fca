"""Did-you-mean for unknown config keys, searching the whole schema (not only the same section).

The schema is flattened into a tree of key names (`*` stands for the free key of a mapping of
sections, e.g. `placement.pools.<name>`). An unknown key is compared with every known path by
its last key (so `actor.lr` finds `actor.optim.lr` and `temprature` finds `rollout.temperature`);
ties between equally close keys are broken by the similarity of the whole dotted path and by
staying in the same section. Similarity is difflib's ratio. A key of an earlier version
(`RETIRED`) is answered with the key that replaced it.
"""

from __future__ import annotations

import types
import typing
from difflib import SequenceMatcher
from functools import cache

from pydantic import BaseModel

__all__ = ["schema_tree", "schema_paths", "unknown_key_message"]

Tree = dict[str, "Tree | None"]  # key -> subtree (a section) or None (a leaf value)
ANY_KEY = "*"

# Spellings used by other frameworks, mapped to ours (compared by the last path component).
SYNONYMS = {
    "learning_rate": "lr", "num_generations": "n", "max_tokens": "max_new_tokens",
    "max_completion_length": "max_new_tokens", "response_length": "max_new_tokens",
    "max_grad_norm": "grad_clip", "epochs": "ppo_epochs", "clip_ratio": "clip_low",
    "train_batch_size": "prompts_per_step", "total_training_steps": "total_steps", "steps": "total_steps",
    "max_steps": "total_steps", "num_steps": "total_steps", "model_name": "path", "model_name_or_path": "path",
}
# Keys of earlier raygraph versions: dotted path -> (the key that replaces it, how). Said instead
# of a did-you-mean, which would only find a look-alike.
RETIRED = {
    "model.build_tiny": ("model.tiny", "model.tiny: <preset> builds a random-init tiny model at "
                         "<trainer.output_dir>/models/tiny-<preset> (leave model.path out); model.tiny: null "
                         "trains the model at model.path"),
    "model.tiny_size": ("model.tiny", "the preset is now model.tiny: <preset>, which also turns the tiny model "
                        "on (leave model.path out); model.tiny: null trains the model at model.path"),
}
_CUTOFF = 0.6  # minimum similarity of the last key for a suggestion (difflib's default)


def _section_of(annotation) -> tuple[type[BaseModel] | None, bool]:
    """(model class, is a mapping of that model) for a field annotation, or (None, False)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _section_of(args[0])
    if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return args[1], True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


@cache
def schema_tree(model: type[BaseModel]) -> Tree:
    """Nested dict of the keys of `model`; sections map to subtrees, leaves to None."""
    tree: Tree = {}
    for name, field in model.model_fields.items():
        section, is_mapping = _section_of(field.annotation)
        if section is None:
            tree[name] = None
        elif is_mapping:
            tree[name] = {ANY_KEY: schema_tree(section)}
        else:
            tree[name] = schema_tree(section)
    return tree


def schema_paths(tree: Tree) -> list[tuple[str, ...]]:
    """Every path in `tree` (sections and leaves), depth first."""
    return [path for path, _ in _walk(tree, ())]


def _walk(tree: Tree, prefix: tuple[str, ...]) -> list[tuple[tuple[str, ...], bool]]:
    """(path, is a section) for every path below `prefix`, depth first."""
    paths = []
    for key, sub in tree.items():
        path = (*prefix, key)
        if key != ANY_KEY:
            paths.append((path, sub is not None))
        if sub is not None:
            paths.extend(_walk(sub, path))
    return paths


def _known_depth(tree: Tree, path: tuple[str, ...]) -> tuple[Tree | None, tuple[str, ...]]:
    """Follow `path` down `tree` while its keys exist; return (subtree reached, canonical keys so far).

    Canonical keys use `*` where the schema has a free key (a mapping of sections).
    """
    canonical: list[str] = []
    for key in path:
        if tree is None or (key not in tree and ANY_KEY not in tree):
            break
        step = key if key in tree else ANY_KEY
        canonical.append(step)
        tree = tree[step]
    return tree, tuple(canonical)


def _render(candidate: tuple[str, ...], user: tuple[str, ...]) -> str:
    """Dotted candidate with `*` replaced by the user's own key where the paths line up."""
    parts = [user[i] if key == ANY_KEY and i < len(user) - 1 else "<name>" if key == ANY_KEY else key
             for i, key in enumerate(candidate)]
    return ".".join(parts)


def _leaf_similarity(user: str, candidate: str) -> float:
    """difflib ratio, or 0.9 when every `_`-separated word of `user` is a word of `candidate`."""
    words = set(user.split("_"))
    contained = 0.9 if words <= set(candidate.split("_")) else 0.0
    return max(SequenceMatcher(None, user, candidate).ratio(), contained)


def _closest(tree: Tree, path: tuple[str, ...]) -> str | None:
    """Best-scoring schema path: similar last key first, then similar whole path, then same section."""
    leaf = SYNONYMS.get(path[-1].lower(), path[-1].lower())
    user = ".".join(path).lower()
    best, best_score = None, 0.0
    for candidate, is_section in _walk(tree, ()):
        if is_section and len(candidate) != len(path):
            continue  # a section is only suggested for a misspelled section at the same depth
        leaf_score = _leaf_similarity(leaf, candidate[-1])
        if leaf_score < _CUTOFF:
            continue
        rendered = _render(candidate, path)
        path_score = SequenceMatcher(None, user, rendered).ratio()
        same_section = 0.25 if candidate[0] == path[0] else 0.0
        score = leaf_score + 0.5 * path_score + same_section
        if score > best_score:
            best, best_score = rendered, score
    return best


def unknown_key_message(tree: Tree, path: tuple[str, ...]) -> str:
    """`a.b is not a field; did you mean a.c.b?` (or the valid keys where the path leaves the schema)."""
    dotted = ".".join(path)
    if dotted in RETIRED:
        key, how = RETIRED[dotted]
        return f"{dotted} is not a field any more; did you mean {key}? {how}"
    suggestion = _closest(tree, path)
    if suggestion is not None:
        return f"{dotted} is not a field; did you mean {suggestion}?"
    parent, canonical = _known_depth(tree, path[:-1])
    keys = ", ".join(k for k in (parent or {}) if k != ANY_KEY)
    where = f"in {'.'.join(path[:len(canonical)])}" if canonical else "at the top level"
    return f"{dotted} is not a field; valid keys {where}: {keys}"
