"""Model-info cache: a model's config, generation config and tokenizer without importing transformers.

transformers takes about two seconds of a warm start to parse two small JSON files (importing
``AutoConfig`` pulls in most of the library) and builds a tokenizer around a ``tokenizers`` one.
After the first load this module stores, in ``cache_dir/model_info/<key>/`` (written atomically,
``checksums.json`` verified before anything is parsed, as the compile cache):

- ``snapshot.json``: every attribute of the transformers config and generation config whose value
  survives a JSON round trip unchanged (torch dtypes by name), the names of all their other
  attributes and methods, and the tokenizer's special tokens, chat template and decode defaults;
- ``tokenizer.json``: the ``tokenizers`` backend exactly as transformers set it up.

A later load answers from :class:`ConfigView` / :class:`~fxcompiler.models.light_tokenizer.LightTokenizer`;
an attribute outside the snapshot (a method such as ``save_pretrained``, a nested config object)
loads the transformers object on first use and is answered by it. The tokenizer snapshot is used
only if it agreed with the transformers tokenizer on probe texts (encode/decode with and without
special tokens, unicode, the chat template) when it was written. The key holds the model files'
identity, the model id, transformers' and tokenizers' versions and the compiler's code fingerprint;
user tokenizers, ``hf_overrides`` and ``trust_remote_code`` bypass the cache.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .loader import LoadedModel, check_decoder_only, load_config, load_tokenizer, model_directory
from .light_tokenizer import SPECIAL_ATTRIBUTES, Deferred, LightTokenizer, backend_from_str
from .sources import ModelSource

log = logging.getLogger("fxcompiler.models")

SNAPSHOT_SCHEMA = 1
DIRECTORY = "model_info"
_VIEW_OWN = frozenset({"_values", "_names", "_load", "_real", "_sets", "_what", "_lock"})
PROBE_TEXTS = (
    "Hello, world! How are you today?",
    "  leading spaces,  double  spaces\n\nnew lines\tand a tab ",
    "unicode: héllo wörld — naïve café, 日本語のテキスト, Привет, مرحبا, 🤖👩‍👩‍👧 \u200b end",
    "numbers 1234567 and 3.14159, code: def f(x):\n    return x**2  # comment",
    "don't I'm they're we've it's . , ? ! ' quotes '",
)


class ConfigView:
    """A transformers config (or generation config) answered from a verified snapshot: attribute reads of
    snapshot values; names the object has but the snapshot lacks load the object (``load``) and ask it;
    names it does not have raise AttributeError without loading it."""

    def __init__(self, values: dict[str, Any], names: frozenset[str], load: Callable[[], Any], what: str):
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_load", load)
        object.__setattr__(self, "_real", None)
        object.__setattr__(self, "_sets", {})
        object.__setattr__(self, "_what", what)
        object.__setattr__(self, "_lock", threading.Lock())

    @property
    def hf_object(self) -> Any:
        """The transformers object (loaded on first use, with the attributes set on this view applied)."""
        real = self.__dict__["_real"]
        if real is None:
            with self.__dict__["_lock"]:
                real = self.__dict__["_real"]
                if real is None:
                    log.info("loading the transformers %s (attribute outside its snapshot)", self.__dict__["_what"])
                    real = self.__dict__["_load"]()
                    for k, v in self.__dict__["_sets"].items():
                        setattr(real, k, v)
                    object.__setattr__(self, "_real", real)
        return real

    def __getattr__(self, name: str) -> Any:
        if name in _VIEW_OWN or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        values = self.__dict__["_values"]
        if name in values:
            return values[name]
        if name not in self.__dict__["_names"]:
            raise AttributeError(f"{self.__dict__['_what']} has no attribute {name!r}")
        return getattr(self.hf_object, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__["_values"][name] = value
        self.__dict__["_sets"][name] = value
        if self.__dict__["_real"] is not None:
            setattr(self.__dict__["_real"], name, value)

    def __repr__(self) -> str:
        return f"ConfigView({self.__dict__['_what']}: {self.__dict__['_values']!r})"


# -- snapshot values --------------------------------------------------------------------------------
def _encode_value(value: Any) -> tuple[bool, Any]:
    """(True, JSON form) for a value that a JSON round trip gives back equal and of the same type."""
    if isinstance(value, torch.dtype):
        return True, {"__torch_dtype__": str(value).removeprefix("torch.")}
    try:
        back = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return False, None
    return (type(back) is type(value) and back == value and _same_types(back, value)), back


def _same_types(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_types(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_types(x, y) for x, y in zip(a, b))
    return True


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__torch_dtype__"}:
        dtype = getattr(torch, value["__torch_dtype__"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {value['__torch_dtype__']!r}")
        return dtype
    return value


def object_snapshot(obj: Any) -> dict[str, Any]:
    """``{"values", "names"}`` of a transformers config object (see the module doc)."""
    values = {}
    candidates = dict(vars(obj))
    for alias in getattr(type(obj), "attribute_map", {}) or {}:
        try:
            candidates[alias] = getattr(obj, alias)
        except AttributeError:
            pass
    for key, value in candidates.items():
        ok, enc = _encode_value(value)
        if ok:
            values[key] = enc
    names = sorted(set(dir(obj)) | set(vars(obj)))
    return {"values": values, "names": names}


def tokenizer_snapshot(tok: Any) -> tuple[dict[str, Any], str] | None:
    """(meta, backend JSON) of a transformers fast tokenizer; None for one without a ``tokenizers`` backend."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    meta = {}
    for attr in SPECIAL_ATTRIBUTES:
        try:
            value = getattr(tok, attr)
        except (AttributeError, ValueError, KeyError):
            continue
        ok, enc = _encode_value(value)
        if ok:
            meta[attr] = enc
    meta["cleanup_skipped_for_bpe"] = bool(
        type(backend.model).__name__ == "BPE"
        and not getattr(tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    return meta, backend.to_str()


def probe_differences(hf: Any, light: LightTokenizer) -> list[str]:
    """Where ``light`` answers differently from the transformers tokenizer ``hf`` on the probes (empty: none)."""
    diffs: list[str] = []

    def same(what: str, f: Callable[[Any], Any]) -> None:
        try:
            a = ("ok", f(hf))
        except Exception as exc:  # noqa: BLE001 - both sides must fail alike
            a = ("raised", type(exc).__name__)
        try:
            b = ("ok", f(light))
        except Exception as exc:  # noqa: BLE001
            b = ("raised", type(exc).__name__)
        if a != b:
            diffs.append(f"{what}: {a!r:.200} != {b!r:.200}")

    specials = [t for t in (getattr(hf, "all_special_tokens", None) or []) if isinstance(t, str)]
    texts = list(PROBE_TEXTS) + [f"{s}text{s} between {s}" for s in specials[:8]]
    same("len", len)
    same("vocab", lambda t: t.get_vocab())
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "special_tokens_map"):
        same(attr, lambda t, a=attr: getattr(t, a))
    for text in texts:
        for special in (True, False):
            same(f"encode {text[:20]!r} {special}", lambda t: list(t(text, add_special_tokens=special)["input_ids"]))
        ids = list(hf(text)["input_ids"])
        for skip in (True, False):
            for clean in (None, False, True):
                same(f"decode {text[:20]!r} {skip} {clean}",
                     lambda t: t.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean))
            for n in range(1, min(len(ids), 12) + 1):  # prefixes end inside multi-byte characters
                same(f"decode prefix {n}", lambda t: t.decode(ids[:n], skip_special_tokens=skip))
    all_ids = list(getattr(hf, "all_special_ids", None) or [])
    for skip in (True, False):
        same(f"decode special ids {skip}", lambda t: t.decode(all_ids + [0, 1, 2], skip_special_tokens=skip))
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROBE_TEXTS[2]},
            {"role": "assistant", "content": "Sure — ok."}, {"role": "user", "content": "again?"}]
    for gen in (True, False):
        same(f"chat template {gen}", lambda t: t.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen))
    same("chat template, no system", lambda t: t.apply_chat_template(chat[1:2], tokenize=False,
                                                                    add_generation_prompt=True))
    same("chat template, continue", lambda t: t.apply_chat_template(chat[:3], tokenize=False,
                                                                   continue_final_message=True))
    return diffs


# -- the cache entry ------------------------------------------------------------------------------
# the code that loads, checks and snapshots a model's config and tokenizer: a change to it is a new key
_SNAPSHOT_CODE = ("info_cache.py", "light_tokenizer.py", "loader.py", "support_check.py", "sources.py")


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    h = hashlib.sha256()
    for name in _SNAPSHOT_CODE:
        h.update(name.encode())
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()


def cache_key(source: ModelSource, model_dir: Path) -> str:
    """The entry of ``source``'s model directory for this snapshot code, transformers and tokenizers version."""
    from importlib.metadata import version

    from ..compile_cache import model_files_identity

    inputs = {"schema": SNAPSHOT_SCHEMA, "code": _code_fingerprint(), "transformers": version("transformers"),
              "tokenizers": version("tokenizers"), "torch": torch.__version__, "model_id": source.model_id,
              "source": source.kind, "files": model_files_identity(model_dir)}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]


def usable(cache_dir: Any, hf_overrides: Any, trust_remote_code: bool, tokenizer: Any, tokenizer_mode: str) -> bool:
    """Whether this load may use the model-info cache (see the module doc)."""
    enabled = os.environ.get("FXCOMPILER_COMPILE_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")
    return (enabled and cache_dir is not None and not hf_overrides and not trust_remote_code and tokenizer is None
            and tokenizer_mode == "auto")


def load_model_and_tokenizer(source: ModelSource, *, cache_dir: Any, hf_overrides: dict[str, Any] | None = None,
                             trust_remote_code: bool = False, tokenizer: Any = None,
                             tokenizer_mode: str = "auto") -> tuple[LoadedModel, Any]:
    """:func:`~fxcompiler.models.loader.load_model_info` and :func:`~fxcompiler.models.loader.load_tokenizer`,
    answered from the model-info cache when it holds this model (else loaded, then stored)."""
    from .loader import load_model_info

    if not usable(cache_dir, hf_overrides, trust_remote_code, tokenizer, tokenizer_mode):
        loaded = load_model_info(source, cache_dir=cache_dir, hf_overrides=hf_overrides,
                                 trust_remote_code=trust_remote_code)
        return loaded, load_tokenizer(loaded.model_dir, tokenizer, tokenizer_mode, trust_remote_code)
    model_dir = model_directory(source, cache_dir)
    key = cache_key(source, model_dir)
    entry = Path(cache_dir) / DIRECTORY / key
    hit = read_entry(entry, model_dir, source.model_id, cache_dir)
    if hit is not None:
        return hit
    loaded = load_model_info(source, cache_dir=cache_dir)
    tok = load_tokenizer(loaded.model_dir)
    store_entry(entry, loaded, tok)
    return loaded, tok


def _quietly(f: Callable, *args: Any) -> Any:
    """``f(*args)`` with transformers' logger silenced (the probes ask for what it warns about)."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return f(*args)
    finally:
        logger.setLevel(level)


def _hf_loaders(model_dir: Path) -> tuple[Callable, Callable, Callable]:
    def config():
        c = load_config(model_dir, None, False)
        check_decoder_only(c)
        return c

    def generation_config():
        from transformers import GenerationConfig

        try:
            return GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
        except (OSError, ValueError):
            return GenerationConfig.from_model_config(config())

    def tokenizer():
        tok = load_tokenizer(model_dir)
        if tok is None:
            raise RuntimeError(f"{model_dir}: the tokenizer that was cached there no longer loads")
        return tok

    return config, generation_config, tokenizer


def read_entry(entry: Path, model_dir: Path, model_id: str, cache_dir: Any) -> tuple[LoadedModel, Any] | None:
    """The cached config views and tokenizer of ``entry`` (verified first), or None (absent; a damaged or
    unreadable entry is removed, with the reason logged, and rebuilt by the caller)."""
    if not (entry / "snapshot.json").is_file():
        if entry.exists():
            log.warning("model-info cache entry %s has no snapshot.json; removing it", entry)
            shutil.rmtree(entry, ignore_errors=True)
        return None
    t0 = time.perf_counter()
    try:
        from ..integrity import stamp_store, verify_checksums

        verify_checksums(entry, stamps=stamp_store(cache_dir))  # verify, then parse
        snap = json.loads((entry / "snapshot.json").read_text())
        if snap.get("schema") != SNAPSHOT_SCHEMA:
            raise ValueError(f"schema {snap.get('schema')!r} != {SNAPSHOT_SCHEMA}")
        load_config_, load_gen, load_tok = _hf_loaders(model_dir)
        config = _view(snap["config"], load_config_, "config")
        gen = _view(snap["generation_config"], load_gen, "generation config")
        tok = None
        if snap["tokenizer"] == "transformers":  # no tokenizers backend, or it disagreed on the probes
            tok = load_tokenizer(model_dir)
        elif snap["tokenizer"] is not None:  # the backend builds in the background (~0.1 s for 49k tokens)
            meta = {k: _decode_value(v) for k, v in snap["tokenizer"].items()}
            tok = LightTokenizer(Deferred(backend_from_str, (entry / "tokenizer.json").read_text()), meta, load_tok)
    except Exception as exc:  # noqa: BLE001 - a damaged entry is rebuilt, never trusted
        log.warning("model-info cache entry %s is unreadable (%s); rebuilding it", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    log.info("model-info cache hit %s (%.3fs)", entry.name, time.perf_counter() - t0)
    from ..cache_limits import mark_used

    mark_used(entry)  # recency for the cache size limit
    return LoadedModel(None, config, gen, model_id, model_dir), tok


def _view(snap: dict[str, Any], load: Callable[[], Any], what: str) -> ConfigView:
    if not isinstance(snap, dict) or not isinstance(snap.get("values"), dict) or not isinstance(snap.get("names"), list):
        raise ValueError(f"malformed {what} record")
    values = {k: _decode_value(v) for k, v in snap["values"].items()}
    return ConfigView(values, frozenset(snap["names"]), load, what)


def store_entry(entry: Path, loaded: LoadedModel, tok: Any) -> None:
    """Write the snapshot of ``loaded``'s configs and ``tok`` (probed first) to ``entry``."""
    from ..compile_cache import write_entry
    from ..integrity import write_checksums

    tok_record: Any = None
    backend_json = None
    if tok is not None:
        snap = tokenizer_snapshot(tok)
        tok_record = "transformers"
        if snap is not None:
            meta, backend_json = snap
            light = LightTokenizer(backend_from_str(backend_json), {k: _decode_value(v) for k, v in meta.items()},
                                   lambda: tok)
            diffs = _quietly(probe_differences, tok, light)
            if diffs:
                log.info("the tokenizers backend of %s differs from transformers' tokenizer (%s); warm starts load "
                         "the transformers tokenizer", loaded.model_id, "; ".join(diffs[:3]))
                backend_json = None
            else:
                tok_record = meta
    snapshot = {"schema": SNAPSHOT_SCHEMA, "model_id": loaded.model_id,
                "config": object_snapshot(loaded.config),
                "generation_config": object_snapshot(loaded.generation_config), "tokenizer": tok_record}

    def write(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        (tmp / "snapshot.json").write_text(json.dumps(snapshot, indent=1, sort_keys=True))
        if backend_json is not None:
            (tmp / "tokenizer.json").write_text(backend_json)
        write_checksums(tmp)

    write_entry(entry, write, "model-info cache")
