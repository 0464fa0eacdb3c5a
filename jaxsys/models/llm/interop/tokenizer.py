"""Text <-> token ids without torch: a ``tokenizers.Tokenizer`` (the Rust library) and a jinja2 chat template.

:class:`Tokenizer` is what :func:`jaxsys.models.load_pretrained`, :func:`jaxsys.models.llm.interop.gguf.load_tokenizer`
and the CLIs hand out. It implements the part of the ``transformers`` tokenizer interface that the
library uses, with the same ids and text as ``transformers``' tokenizer built from the same file
(checked on a held set in tests/models/test_smollm2.py):

* ``tok(text)["input_ids"]``, ``tok.encode(text, add_special_tokens=True)``, ``tok.decode(ids,
  skip_special_tokens=False)``, ``len(tok)``, ``convert_tokens_to_ids`` / ``convert_ids_to_tokens``;
* ``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``unk_token_id`` (and the ``*_token`` strings);
* ``apply_chat_template(messages, tools=None, add_generation_prompt=False, tokenize=True)``: the
  template renders in jinja2's immutable sandbox with ``transformers``' globals (``raise_exception``,
  ``strftime_now``, a ``tojson`` that does not escape HTML, ``loopcontrols``, ``trim_blocks`` and
  ``lstrip_blocks``) and the special tokens as variables; the rendered text is encoded without
  special-token post-processing, as ``transformers`` does;
* ``save_pretrained(folder)`` writes ``tokenizer.json``, ``tokenizer_config.json`` (with the chat
  template) and ``special_tokens_map.json``, which ``transformers.AutoTokenizer`` loads;
  :meth:`Tokenizer.from_folder` reads such a folder (a Hugging Face checkpoint's tokenizer too).

Built from GGUF metadata (:meth:`Tokenizer.from_gguf_metadata`, the ``tokenizer.*`` keys of llama.cpp):
``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen2 files) with the
split rule that ``tokenizer.ggml.pre`` names (:data:`PRE_SPLITS`), or ``"llama"`` (sentencepiece BPE:
Llama 2, Mistral, TinyLlama files; byte fallback, merges from the file or recovered from the scores,
BOS added unless ``tokenizer.ggml.add_bos_token`` says otherwise). Tokens of type CONTROL become
special tokens (kept whole, dropped by ``skip_special_tokens``), USER_DEFINED ones added tokens.
Other tokenizer models (``t5``, ...) and unknown split rules are a ``ConfigError`` naming the key and
value: guessing a split rule would give wrong ids silently. tests/models/test_gguf.py checks each
kind and split rule against transformers' own GGUF tokenizer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxsys.core.errors import ConfigError, InputError

__all__ = ["Tokenizer", "PRE_SPLITS", "bytes_to_unicode"]

# Pre-tokenizer split rules by ``tokenizer.ggml.pre``; None: byte-level BPE's own (GPT-2) rule.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS: dict[str, str | None] = {
    "default": None, "gpt2": None, "smollm": None,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "smaug-bpe": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's tokenizer.ggml.token_type values
_SPECIAL_NAMES = ("bos", "eos", "unk", "pad")
_GGUF_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
             "pad": "padding_token_id"}


def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table: the alphabet byte-level BPE vocabularies are spelled in."""
  keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
      list(range(ord("®"), ord("ÿ") + 1))
  chars, n = keep[:], 0
  for b in range(256):
    if b not in keep:
      keep.append(b)
      chars.append(256 + n)
      n += 1
  return dict(zip(keep, map(chr, chars)))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str):
  """The chat template in jinja2's immutable sandbox, with the environment transformers gives it."""
  import datetime  # noqa: PLC0415

  import jinja2  # noqa: PLC0415
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    return env.from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise InputError(f"chat_template does not parse as a jinja2 template: {e}") from e


class Tokenizer:
  """A ``tokenizers.Tokenizer`` with special tokens and a chat template (see the module docstring).

  ``special``: ``{"bos": "<s>", "eos": ..., "unk": ..., "pad": ...}`` token strings (None where
  the model has none); each must be in the vocabulary.
  """

  def __init__(self, backend, *, special: Mapping[str, str | None] | None = None,
               chat_template: str | None = None, add_bos_token: bool = False, add_eos_token: bool = False):
    self.backend = backend
    self.chat_template = chat_template
    self.add_bos_token, self.add_eos_token = bool(add_bos_token), bool(add_eos_token)
    special = dict(special or {})
    unknown = sorted(set(special) - set(_SPECIAL_NAMES))
    if unknown:
      raise ConfigError(f"special={unknown} are not special-token names; use {list(_SPECIAL_NAMES)}")
    self._special = {k: special.get(k) for k in _SPECIAL_NAMES}
    for name, tok in self._special.items():
      if tok is not None and backend.token_to_id(tok) is None:
        raise ConfigError(f"{name}_token={tok!r} is not in the vocabulary")
    self._template = None if chat_template is None else _compile_template(chat_template)

  # ---- construction

  @classmethod
  def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer that a GGUF file's ``tokenizer.*`` metadata describes (module docstring)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers  # noqa: PLC0415
    from tokenizers import Tokenizer as Backend  # noqa: PLC0415
    kind = meta.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
      raise ConfigError(f"tokenizer.ggml.model={kind!r} is not supported (only 'gpt2', byte-level BPE, and "
                        "'llama', sentencepiece BPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
      raise InputError("the GGUF metadata has no tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "llama":
      return cls._sentencepiece(meta, tokens, types)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
      raise ConfigError(f"tokenizer.ggml.pre={pre!r} is not supported; known split rules: {sorted(PRE_SPLITS)}")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Byte-level vocabularies spell every token in the byte alphabet; a token outside it (a
    # special token written plainly) is respelled so that the BPE model can hold it.
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
    split = PRE_SPLITS[pre]
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # CONTROL tokens outside the byte alphabet are llama.cpp mislabels; adding them would grow
    # the vocabulary past the model's (transformers skips them too).
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == _CONTROL and set(t) <= alphabet]
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab]
    backend.add_special_tokens(control)
    backend.add_tokens(user)
    return cls._finish_gguf(backend, meta, tokens, add_bos=False)

  @classmethod
  def _sentencepiece(cls, meta, tokens, types) -> Tokenizer:
    """``tokenizer.ggml.model == "llama"``: sentencepiece BPE (Llama 2, Mistral, TinyLlama files) as
    transformers' ``LlamaTokenizer`` builds it: byte fallback, a "▁" word prefix on the first word,
    merges from the file or, where it has none, recovered from the vocabulary ranked by score."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers  # noqa: PLC0415
    from tokenizers import Tokenizer as Backend  # noqa: PLC0415
    vocab = {t: i for i, t in enumerate(tokens)}
    if meta.get("tokenizer.ggml.merges"):
      merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    else:
      scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
      merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise
    return cls._finish_gguf(backend, meta, tokens, add_bos=True)

  @classmethod
  def _finish_gguf(cls, backend, meta, tokens, add_bos: bool) -> Tokenizer:
    special = {}
    for name, key in _GGUF_IDS.items():
      i = meta.get(f"tokenizer.ggml.{key}")
      if i is not None:
        if not 0 <= int(i) < len(tokens):
          raise InputError(f"tokenizer.ggml.{key}={i} is outside the vocabulary of {len(tokens)} tokens")
        special[name] = tokens[int(i)]
    tok = cls(backend, special=special, chat_template=meta.get("tokenizer.chat_template"),
              add_bos_token=meta.get("tokenizer.ggml.add_bos_token", add_bos),
              add_eos_token=meta.get("tokenizer.ggml.add_eos_token", False))
    tok._set_post_processor()
    return tok

  @classmethod
  def from_folder(cls, folder: str | os.PathLike) -> Tokenizer:
    """Reads ``tokenizer.json`` and ``tokenizer_config.json`` (and ``chat_template.jinja`` /
    ``special_tokens_map.json`` where present) from a folder, as :meth:`save_pretrained` writes
    them and Hugging Face checkpoints ship them. JSON only: nothing is executed or unpickled."""
    from tokenizers import Tokenizer as Backend  # noqa: PLC0415
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
      raise InputError(f"{folder} has no tokenizer.json")
    backend = Backend.from_file(str(folder / "tokenizer.json"))
    config = _read_json(folder / "tokenizer_config.json")
    special_map = _read_json(folder / "special_tokens_map.json")
    special = {n: _token_text(config.get(f"{n}_token", special_map.get(f"{n}_token"))) for n in _SPECIAL_NAMES}
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
      template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return cls(backend, special=special, chat_template=template,
               add_bos_token=config.get("add_bos_token", False), add_eos_token=config.get("add_eos_token", False))

  def _set_post_processor(self) -> None:
    """``add_bos_token`` / ``add_eos_token`` as the backend's post-processor, so ``tokenizer.json``
    carries them too."""
    from tokenizers import processors  # noqa: PLC0415
    bos = [f"{self.bos_token}:0"] if self.add_bos_token and self.bos_token is not None else []
    eos = [f"{self.eos_token}:0"] if self.add_eos_token and self.eos_token is not None else []
    if not bos and not eos:
      return
    single = bos + ["$A:0"] + eos
    used = [t.rsplit(":", 1)[0] for t in bos + eos]
    self.backend.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(single + bos + ["$B:1"] + eos),
        special_tokens=[(t, self.backend.token_to_id(t)) for t in dict.fromkeys(used)])

  # ---- the transformers-style interface

  def __len__(self) -> int:
    return self.backend.get_vocab_size(with_added_tokens=True)

  def __repr__(self) -> str:
    return f"Tokenizer(vocab={len(self)}, special={self._special}, chat_template={self.chat_template is not None})"

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    if not isinstance(text, str):
      raise InputError(f"text must be a string, got {type(text).__name__}")
    return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

  def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, list]:
    """``{"input_ids": ids}`` for a string, ``{"input_ids": [ids, ...]}`` for a list of strings."""
    if isinstance(text, str):
      return {"input_ids": self.encode(text, add_special_tokens)}
    return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def convert_tokens_to_ids(self, tokens: str | Sequence[str]):
    if isinstance(tokens, str):
      return self.backend.token_to_id(tokens)
    return [self.backend.token_to_id(t) for t in tokens]

  def convert_ids_to_tokens(self, ids: int | Sequence[int]):
    if isinstance(ids, int):
      return self.backend.id_to_token(ids)
    return [self.backend.id_to_token(int(i)) for i in ids]

  def get_vocab(self) -> dict[str, int]:
    return self.backend.get_vocab(with_added_tokens=True)

  @property
  def special_tokens_map(self) -> dict[str, str]:
    return {f"{k}_token": v for k, v in self._special.items() if v is not None}

  def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], tools=None, documents=None,
                          add_generation_prompt: bool = False, tokenize: bool = True, **kwargs):
    """The chat rendered with the template (a string with ``tokenize=False``, else its ids)."""
    if self._template is None:
      raise ConfigError("this tokenizer has no chat_template")
    if isinstance(conversation, Mapping) or not isinstance(conversation, Sequence) or \
        not all(isinstance(m, Mapping) for m in conversation):
      raise InputError("conversation must be a list of {'role', 'content'} messages")
    text = self._template.render(messages=[dict(m) for m in conversation], tools=tools, documents=documents,
                                 add_generation_prompt=add_generation_prompt,
                                 **self.special_tokens_map, **kwargs)
    return self.encode(text, add_special_tokens=False) if tokenize else text

  def save_pretrained(self, folder: str | os.PathLike) -> Path:
    """Writes ``tokenizer.json``, ``tokenizer_config.json`` (chat template included) and
    ``special_tokens_map.json`` into ``folder`` (created if missing)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    self.backend.save(str(folder / "tokenizer.json"))
    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                      "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
             for i, t in sorted(self.backend.get_added_tokens_decoder().items())}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos_token,
              "add_eos_token": self.add_eos_token, "clean_up_tokenization_spaces": False,
              "added_tokens_decoder": added, **self.special_tokens_map}
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps(self.special_tokens_map, indent=2,
                                                               ensure_ascii=False) + "\n", encoding="utf-8")
    return folder


def _special_property(name: str):
  def token(self) -> str | None:
    return self._special[name]

  def token_id(self) -> int | None:
    t = self._special[name]
    return None if t is None else self.backend.token_to_id(t)
  return property(token, doc=f"the {name} token string (None: none)"), \
      property(token_id, doc=f"the {name} token id (None: none)")


for _name in _SPECIAL_NAMES:
  _t, _i = _special_property(_name)
  setattr(Tokenizer, f"{_name}_token", _t)
  setattr(Tokenizer, f"{_name}_token_id", _i)


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
  """BPE merges implied by a sentencepiece vocabulary: every split of a token into two tokens,
  best score first (then shorter left and right pieces), as transformers' ``generate_merges``."""
  merges = []
  for token, score in scores.items():
    local = [(token[:i], token[i:], score) for i in range(1, len(token))
             if token[:i] in vocab and token[i:] in vocab]
    merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
  merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
  return [(a, b) for a, b, _ in merges]


def _read_json(path: Path) -> dict:
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_text(encoding="utf-8"))
  except ValueError as e:
    raise InputError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(data, dict):
    raise InputError(f"{path} must hold a JSON object")
  return data


def _token_text(value) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
  return value.get("content") if isinstance(value, dict) else value
