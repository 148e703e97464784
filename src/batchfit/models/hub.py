"""Hugging Face configs by hub id: the local cache, then the hub itself (config only).

``hf:ORG/NAME`` names a model as people do, by its id on the Hugging Face hub. batchfit
needs only its ``config.json`` (the architecture), never the weights, as ``accelerate
estimate-memory`` does. Where it looks, in order (:func:`batchfit.models.resolve` puts
batchfit's offline table between the two, so a model it knows needs no network):

1. the local Hugging Face cache (``HF_HUB_CACHE``, by default ``~/.cache/huggingface/hub``),
   where any earlier download of the model left its ``config.json``: read with
   ``huggingface_hub.try_to_load_from_cache``, which resolves ``refs/main`` to a snapshot;
2. the hub, with ``huggingface_hub.hf_hub_download`` (which caches the file for next time,
   and sends the user's token for gated models), unless ``HF_HUB_OFFLINE`` is set.

``huggingface_hub`` comes with ``transformers``, which every ``hf:`` model needs anyway.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchfit.errors import ModelSpecError

CONFIG_FILE = "config.json"


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is a valid hub id (``gpt2``, ``HuggingFaceTB/SmolLM2-1.7B``)."""
    hub = _hub()
    if hub is None:
        return False
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except Exception:  # HFValidationError: not an id (a path, a typo with spaces)
        return False
    return True


def offline() -> bool:
    """``HF_HUB_OFFLINE`` as huggingface_hub reads it (its constants, set at import)."""
    hub = _hub()
    return hub is None or bool(hub.constants.HF_HUB_OFFLINE)


def cached_config(repo_id: str) -> dict[str, Any] | None:
    """``repo_id``'s config.json from the local cache, or None when it was never downloaded."""
    hub = _hub()
    if hub is None:
        return None
    path = hub.try_to_load_from_cache(repo_id, CONFIG_FILE)
    if not isinstance(path, str):  # None, or the cache's "known not to exist" marker
        return None
    return _read(Path(path), repo_id)


def download_config(repo_id: str) -> dict[str, Any]:
    """``repo_id``'s config.json from the hub (cached for next time).

    Raises:
        ModelSpecError: the repository or its config does not exist, is gated without a
            token, or the hub cannot be reached; one line saying how to fix it.
    """
    hub = _hub()
    if hub is None:  # pragma: no cover - transformers brings huggingface_hub
        raise ModelSpecError("reading a config from the hub needs huggingface_hub: "
                             "pip install huggingface_hub")
    from huggingface_hub import errors

    local = "or put its config.json in a local directory and pass hf:path/to/dir"
    try:
        path = hub.hf_hub_download(repo_id, CONFIG_FILE)
    except errors.GatedRepoError as exc:
        raise ModelSpecError(
            f"hf model '{repo_id}' is gated on the Hugging Face hub: accept its licence on "
            f"its page and log in (hf auth login), {local}") from exc
    except errors.RepositoryNotFoundError as exc:
        raise ModelSpecError(
            f"no model '{repo_id}' on the Hugging Face hub (or it is private: log in with "
            f"hf auth login): check the name, {local}") from exc
    except errors.EntryNotFoundError as exc:
        raise ModelSpecError(f"hf model '{repo_id}' has no {CONFIG_FILE} on the hub: it is "
                             f"not a transformers model; {local}") from exc
    except Exception as exc:  # network failures: huggingface_hub's, httpx's, OSError
        raise ModelSpecError(
            f"could not read the config of hf model '{repo_id}' from the Hugging Face hub "
            f"({type(exc).__name__}): check the network, or set HF_HUB_OFFLINE=1 and {local}"
        ) from exc
    return _read(Path(path), repo_id)


def offline_hint(repo_id: str) -> str:
    """How to make ``repo_id`` readable without the network."""
    return (f"it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: download "
            f"its config once (hf download {repo_id} {CONFIG_FILE}), or put its config.json "
            "in a local directory and pass hf:path/to/dir")


def _read(path: Path, repo_id: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"cannot read the cached config of '{repo_id}' ({path}): "
                             f"{type(exc).__name__}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelSpecError(f"the config.json of '{repo_id}' has no \"model_type\": it is "
                             "not a transformers model")
    return config


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants  # a submodule the package does not load itself
    except ImportError:
        return None
    return huggingface_hub
