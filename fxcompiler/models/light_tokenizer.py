"""A tokenizer over the ``tokenizers`` library alone, for warm starts without importing transformers.

Requires: a snapshot written by :mod:`fxcompiler.models.info_cache` from the transformers tokenizer
itself — the backend ``tokenizers.Tokenizer`` as transformers set it up (``backend_tokenizer.to_str()``),
its special tokens, chat template and decode defaults — and checked there against that tokenizer on
probe texts before it was stored.

Ensures: what the engine, ``LLM.generate`` / ``LLM.chat`` and the incremental detokenizer call —
``tok(text, add_special_tokens=...)``, ``encode``, ``decode`` (special tokens skipped or not,
clean-up of tokenization spaces), ``apply_chat_template(..., tokenize=False)``, ``len``,
``get_vocab``, the special-token attributes — return what the transformers tokenizer returns.
Anything else (other arguments, other methods: ``save_pretrained``, ``batch_decode``, a chat
template rendered with ``tokenize=True``, structured-output grammars) is answered by the
transformers tokenizer, loaded on first such use (:attr:`LightTokenizer.hf_tokenizer`).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("fxcompiler.models")

# the fields of the snapshot's "tokenizer" record that the class serves as attributes
SPECIAL_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                      "bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "sep_token_id",
                      "cls_token_id", "mask_token_id", "all_special_tokens", "all_special_ids",
                      "special_tokens_map", "chat_template", "model_max_length", "padding_side",
                      "truncation_side", "name_or_path", "clean_up_tokenization_spaces")
_OWN = frozenset({"_backend_or_future", "_meta", "_load_hf", "_hf", "_lock", "_hf_lock"})


class Encoding(dict):
    """``{"input_ids", "attention_mask"}``, also readable as attributes (as transformers' BatchEncoding)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Deferred:
    """``f(*args)`` computed in a daemon thread; :meth:`result` waits for it (and re-raises its error)."""

    def __init__(self, f: Callable[..., Any], *args: Any):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(f, args), name="fxc-deferred", daemon=True)
        self._thread.start()

    def _run(self, f: Callable[..., Any], args: tuple) -> None:
        try:
            self._value = f(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of result()
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def backend_from_str(text: str) -> Any:
    """The ``tokenizers.Tokenizer`` of a tokenizer.json text, truncation and padding off (transformers resets
    both before every plain encode)."""
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(text)
    backend.no_truncation()
    backend.no_padding()
    return backend


def clean_up_tokenization(text: str) -> str:
    """transformers' ``PreTrainedTokenizerBase.clean_up_tokenization``."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
            .replace(" 're", "'re"))


class LightTokenizer:
    """A transformers fast tokenizer's behaviour over its ``tokenizers`` backend (see the module doc)."""

    def __init__(self, backend: Any, meta: dict[str, Any], load_hf: Callable[[], Any]):
        """``backend``: a ``tokenizers.Tokenizer``, or a future of one (:class:`Deferred`: built in the
        background while the caller loads the rest of the model)."""
        self._backend_or_future = backend
        self._meta = meta
        self._load_hf = load_hf
        self._hf = None
        self._lock = threading.Lock()
        self._hf_lock = threading.Lock()

    @property
    def _backend(self) -> Any:
        backend = self._backend_or_future
        if isinstance(backend, Deferred):
            with self._lock:
                backend = self._backend_or_future
                if isinstance(backend, Deferred):
                    try:
                        backend = backend.result()
                    except Exception as exc:  # noqa: BLE001 - transformers' own backend answers the same
                        log.warning("the cached tokenizer did not load (%s); using transformers' tokenizer", exc)
                        backend = self.hf_tokenizer.backend_tokenizer
                    self._backend_or_future = backend
        return backend

    # -- the transformers tokenizer, for everything not served here ---------------------------------
    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer of the same model (loaded on first use; never None)."""
        if self._hf is None:
            with self._hf_lock:
                if self._hf is None:
                    log.info("loading the transformers tokenizer (a call the tokenizers backend does not serve)")
                    self._hf = self._load_hf()
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name in _OWN or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        if name in SPECIAL_ATTRIBUTES and name in self._meta:
            return self._meta[name]
        return getattr(self.hf_tokenizer, name)

    def __repr__(self) -> str:
        return f"LightTokenizer({self._meta.get('name_or_path')!r}, vocab={len(self)})"

    # -- vocabulary ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def backend_tokenizer(self) -> Any:
        return self._backend

    # -- encode / decode ---------------------------------------------------------------------------
    def __call__(self, text: Any = None, text_pair: Any = None, add_special_tokens: bool = True, **kwargs) -> Any:
        if text_pair is not None or kwargs or not (isinstance(text, str) or (
                isinstance(text, list) and text and all(isinstance(t, str) for t in text))):
            return self.hf_tokenizer(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            enc = self._backend.encode(text, add_special_tokens=add_special_tokens)
            return Encoding(input_ids=enc.ids, attention_mask=enc.attention_mask)
        encs = self._backend.encode_batch(text, add_special_tokens=add_special_tokens)
        return Encoding(input_ids=[e.ids for e in encs], attention_mask=[e.attention_mask for e in encs])

    def encode(self, text: Any, text_pair: Any = None, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if text_pair is not None or kwargs or not isinstance(text, str):
            return self.hf_tokenizer.encode(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if kwargs or not isinstance(token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
            return self.hf_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                            clean_up_tokenization_spaces=clean_up_tokenization_spaces, **kwargs)
        text = self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        clean = (clean_up_tokenization_spaces if clean_up_tokenization_spaces is not None
                 else self._meta.get("clean_up_tokenization_spaces"))
        if clean:
            if self._meta.get("cleanup_skipped_for_bpe"):  # transformers ignores it for BPE (and warns once)
                return text
            text = clean_up_tokenization(text)
        return text

    # -- chat template -------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: Any, tools: Any = None, documents: Any = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True, **kwargs) -> Any:
        """The rendered chat (``tokenize=False``) with jinja2 alone where :mod:`.chat_template` serves the call,
        else with transformers' own renderer; other uses (token ids, masks, sanitised control tokens, named
        templates) by the transformers tokenizer."""
        from . import chat_template as jinja_only

        passthrough = ("sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")
        template = chat_template if chat_template is not None else self._meta.get("chat_template")
        own = not tokenize and jinja_only.supported(template, tools, documents,
                                                    continue_final_message=continue_final_message)
        renderer = _renderer() if not tokenize and not own else None
        if (tokenize or (renderer is None and not own) or any(kwargs.get(k) for k in passthrough)
                or not isinstance(template, str)
                or not isinstance(self._meta.get("chat_template"), str)  # none, or named templates (a dict)
                or (continue_final_message and add_generation_prompt)
                or not isinstance(conversation, (list, tuple)) or not conversation):
            return self.hf_tokenizer.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in passthrough}
        batched = isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages")
        variables = {**self._meta.get("special_tokens_map", {}), **kwargs}
        if own:
            conversations = [jinja_only.normalize_messages(c) for c in (conversation if batched else [conversation])]
            rendered = jinja_only.render(conversations, chat_template=template, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
            return rendered if batched else rendered[0]
        normalize, render = renderer
        conversations = [normalize(c) for c in (conversation if batched else [conversation])]
        rendered, _ = render(conversations=conversations, tools=tools, documents=documents, chat_template=template,
                             return_assistant_tokens_mask=False, continue_final_message=continue_final_message,
                             add_generation_prompt=add_generation_prompt, **variables)
        return rendered if batched else rendered[0]


def _renderer() -> tuple[Callable, Callable] | None:
    """transformers' chat-template message normaliser and Jinja renderer (the functions its tokenizers use);
    None where this transformers version has them elsewhere (then the transformers tokenizer renders)."""
    try:
        from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template
    except ImportError:
        return None
    return _normalize_chat_messages, render_jinja_template
