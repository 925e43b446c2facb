"""Hugging Face ``transformers`` around ``LinearAttentionTransformerLM``: a config, a causal LM
for ``save_pretrained`` / ``from_pretrained`` / ``generate`` / ``Trainer``, the cache that
``generate`` carries, and a byte-level tokenizer (docs/training.md, "With Hugging Face").

Needs ``transformers`` and ``safetensors`` (the ``[hf]`` extra); the package's ``__init__`` does
not import this module. Importing it registers the config and the model with ``AutoConfig``,
``AutoModel`` and ``AutoModelForCausalLM`` under ``model_type = "linear_attention_transformer"``,
so ``from_pretrained`` needs no ``trust_remote_code``. One code path serves transformers 4.57
to 5.24: the cache is a small object of its own (not a subclass of transformers' ``Cache``,
whose interface moves between releases), and both names of the cache keyword (``cache``,
``past_key_values`` before 5.24) are taken.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import warnings

import torch
import torch.nn.functional as F
import transformers
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, GenerationConfig, GenerationMixin,
                          PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast)
from transformers.modeling_outputs import CausalLMOutputWithPast

from . import __version__
from .attention import Attention
from .cache import DecodingCache, map_tensors
from .feedforward import FeedForward
from .linformer import linformer_layers
from .lm import LinearAttentionTransformerLM
from .positional import RotaryEmbedding
from .transformer import LinearAttentionTransformer, refuse_unknown_keywords

__all__ = ["MODEL_TYPE", "CACHE_NAME", "LinearAttentionTransformerConfig", "LinearAttentionTransformerCache",
           "LinearAttentionTransformerForCausalLM", "byte_tokenizer"]

MODEL_TYPE = "linear_attention_transformer"

# the name transformers gives the cache in outputs and in generate's keywords: "cache" from 5.24,
# "past_key_values" before (read from its own output class, so it follows the installed release)
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _library_defaults():
    """Every ``LinearAttentionTransformerLM`` keyword and its default: the first of the
    constructors that take it (the model's, the stack's, the feed-forward's as ``ff_`` + name,
    the attention layers') to give one; None where none does."""
    sources = [(LinearAttentionTransformerLM, ""), (LinearAttentionTransformer, ""), (FeedForward, "ff_"),
               (Attention, ""), (linformer_layers, "")]
    defaults = {}
    for factory, prefix in sources:
        for name, parameter in inspect.signature(factory).parameters.items():
            if parameter.default is not inspect.Parameter.empty:
                defaults.setdefault(prefix + name, parameter.default)
    return {name: defaults.get(name) for name in sorted(LinearAttentionTransformerLM.option_names())}


_LIBRARY_DEFAULTS = _library_defaults()


@functools.cache
def _hf_config_keys():
    """The keywords transformers' own config takes or writes into a config.json, in this release."""
    base = PretrainedConfig()
    keys = set(inspect.signature(PretrainedConfig.__init__).parameters) | set(vars(base)) | set(base.to_dict())
    keys |= set(getattr(GenerationConfig, "_get_default_generation_params", dict)())
    # read by transformers from config.json files though a bare config lacks them
    keys |= {"model_type", "torch_dtype", "name_or_path", "auto_map", "use_cache", "num_labels",
             "attn_implementation", "pad_token_id", "bos_token_id", "eos_token_id"}
    return keys - {"self", "kwargs"}


# the keys of config.json that say which of its keys are this library's options, and the version
# that wrote it: a reader that does not know a listed option cannot build that model
OPTIONS_KEY, VERSION_KEY = "library_options", "library_version"
# difflib's ratio from which an unknown key reads as a misspelt option (a letter missing, added or
# changed, or two swapped, in a name of four or more); below it, more likely another program's key
MISSPELT = 0.75


def _as_json_value(name, value):
    """``value`` as the config keeps it (lists, from JSON, back to tuples); ValueError naming the
    option when JSON cannot hold it."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_json_value(name, v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(f"{name}={value!r}: a Hugging Face config is saved as JSON, which cannot hold a "
                     f"{type(value).__name__}; build LinearAttentionTransformerLM directly for this option")


class LinearAttentionTransformerConfig(PretrainedConfig):
    """Every ``LinearAttentionTransformerLM`` keyword as a config field of the same name (flat,
    as transformers' configs are), with the library's defaults, except ``causal=True`` and
    ``num_tokens=256, dim=512, depth=6, max_seq_len=1024`` where the library has none.

    Per-layer tuples come back as tuples from JSON. An option JSON cannot hold (a callable
    ``feature_map``, ``LinformerSettings``) raises ValueError naming it. transformers' usual
    names read and write the library's: ``vocab_size`` (num_tokens), ``hidden_size`` (dim),
    ``num_hidden_layers`` (depth), ``num_attention_heads`` (heads), ``max_position_embeddings``
    (max_seq_len), ``tie_word_embeddings`` (tie_embedding). transformers' own keywords
    (``pad_token_id``, ``eos_token_id``, ...) pass to its config. ``model_options()``: the
    keywords the model is built with; ``DEFAULTS``: every field's default.

    Keys that are neither: ``to_dict`` (so config.json) also writes ``library_options``, the
    names of this library's options, and ``library_version``, the library's ``__version__``.
    Given those (a config.json that records them), an option listed there that this version
    does not know raises ValueError naming it and the version that wrote it (dropping it would
    build another model), and every other unknown key is kept. Without them (a config made in
    Python, or a config.json that lacks them), a key a letter or so from an option's name
    (``use_gat``) raises TypeError suggesting the option, and every other unknown key is kept.
    A kept key is an attribute of the config, saved with it and not read by the model, as
    transformers keeps the keys it does not know; one ``UserWarning`` names the kept keys. A
    key that would hide an attribute of the class (``model_options``) raises ValueError.
    """

    model_type = MODEL_TYPE
    attribute_map = {"vocab_size": "num_tokens", "hidden_size": "dim", "num_hidden_layers": "depth",
                     "num_attention_heads": "heads", "max_position_embeddings": "max_seq_len",
                     "tie_word_embeddings": "tie_embedding"}
    DEFAULTS = {**_LIBRARY_DEFAULTS, "num_tokens": 256, "dim": 512, "depth": 6, "max_seq_len": 1024, "causal": True}

    def __init__(self, **kwargs):
        for alias, name in self.attribute_map.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"{type(self).__name__} got both {alias!r} and {name!r}, two names of one option")
                kwargs[name] = kwargs.pop(alias)
        listed, writer = kwargs.pop(OPTIONS_KEY, None), kwargs.pop(VERSION_KEY, None)
        options = {name: kwargs.pop(name) for name in self.DEFAULTS if name in kwargs}
        unknown = sorted(name for name in kwargs if name not in _hf_config_keys())
        # a config.json that lists the library's options says exactly which keys are; without the
        # list, a key near an option's name is most likely that option misspelt
        if listed is None:
            library_names = sorted({*self.DEFAULTS, *self.attribute_map})
            refuse_unknown_keywords(type(self).__name__, {name: None for name in unknown if difflib.get_close_matches(
                name, library_names, n=1, cutoff=MISSPELT)}, library_names)
        else:
            self._refuse_options_of_another_release(listed, writer)
        self._keep_unknown_keys(unknown)
        options = {name: _as_json_value(name, value) for name, value in {**self.DEFAULTS, **options}.items()}
        # (transformers 4.57 sets tie_word_embeddings, True unless given: the alias of tie_embedding)
        super().__init__(tie_word_embeddings=options["tie_embedding"], **kwargs)
        for name, value in options.items():
            setattr(self, name, value)

    def _refuse_options_of_another_release(self, listed, writer):
        if not isinstance(listed, (list, tuple)) or not all(isinstance(name, str) for name in listed):
            raise TypeError(f"{OPTIONS_KEY} must be a list of option names, got {listed!r}")
        foreign = sorted(set(listed) - set(self.DEFAULTS))
        if foreign:
            by, advice = ((f"linear_attention_transformer {writer}", f"{writer} or later") if writer is not None else
                          ("linear_attention_transformer (version not recorded)", "the version that wrote it"))
            raise ValueError(f"{type(self).__name__}: {', '.join(map(repr, foreign))}: option(s) listed in "
                             f"{OPTIONS_KEY} by {by}, which this version ({__version__}) does not have; a model "
                             f"built without them would not be the one saved: load it with {advice}")

    def _keep_unknown_keys(self, unknown):
        shadowing = [name for name in unknown if hasattr(type(self), name)]
        if shadowing:
            raise ValueError(f"{type(self).__name__}: {', '.join(map(repr, shadowing))} would hide the config's "
                             f"attribute of that name and cannot be kept")
        if not unknown:
            return

        def described(name):
            close = difflib.get_close_matches(name, sorted(self.DEFAULTS), n=1)
            return repr(name) + (f" (did you mean {close[0]!r}?)" if close else "")

        warnings.warn(f"{type(self).__name__} kept {', '.join(map(described, unknown))}: not option(s) of "
                      f"linear_attention_transformer {__version__} nor key(s) of transformers "
                      f"{transformers.__version__}; saved with the config, not read by the model",
                      UserWarning, stacklevel=3)

    def to_dict(self):
        out = super().to_dict()
        out[OPTIONS_KEY], out[VERSION_KEY] = sorted(self.DEFAULTS), __version__
        return out

    def __eq__(self, other):
        # (transformers 5 makes configs dataclasses whose generated equality sees only its own fields)
        return isinstance(other, type(self)) and self.to_dict() == other.to_dict()

    __hash__ = None

    def model_options(self):
        """The keywords for ``LinearAttentionTransformerLM``: the options that differ from the
        library's defaults, and those it requires."""
        required = {"num_tokens", "dim", "depth", "max_seq_len"}
        return {name: getattr(self, name) for name, default in _LIBRARY_DEFAULTS.items()
                if name in required or getattr(self, name) != _as_json_value(name, default)}


class LinearAttentionTransformerCache:
    """The library's ``DecodingCache`` as transformers' ``generate`` carries it between steps:
    ``state`` (None until the first forward fills it), updated in place by each forward.

    A plain object, not a subclass of transformers' ``Cache``: it offers what ``generate`` reads
    (``get_seq_length``, ``reorder_cache`` for beam search, the flags below, and an
    ``_is_user_defined`` it may set). Every layer is recurrent (``is_linear``): the cache holds
    fixed-size state, nothing to crop or slice. Pass an empty one (or one that ``generate``
    returned) to ``generate`` to have it filled (or continued).
    """

    is_compileable = False
    is_croppable = False
    is_linear = (True,)

    def __init__(self, state: DecodingCache | None = None):
        if state is not None and not isinstance(state, DecodingCache):
            raise TypeError(f"state must be a DecodingCache or None, got {type(state).__name__}")
        self.state = state

    def get_seq_length(self, layer_idx=0):
        """The tokens the cache has consumed (columns, padding included)."""
        return 0 if self.state is None else int(self.state.position)

    def reorder_cache(self, beam_idx):
        """Keep rows ``beam_idx`` (long (b',)), in that order: beam search's reordering."""
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    batch_select_indices = reorder_cache

    def batch_repeat_interleave(self, repeats):
        """Each row ``repeats`` times in place of once (several samples per prompt)."""
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_rows(self, fn):
        # (every cache tensor has the batch first; the position's 0-d tensor, if any, has no rows:
        # copied, so that the new state advances its own)
        if self.state is not None:
            self.state = map_tensors(self.state, lambda t: fn(t) if t.ndim else t.clone())

    def __repr__(self):
        return f"{type(self).__name__}(position={self.get_seq_length()})"


def _the_cache(cache, past_key_values):
    """The cache given under either name (None for none)."""
    if cache is not None and past_key_values is not None:
        raise TypeError("cache and past_key_values are two names of one argument: give one")
    cache = cache if cache is not None else past_key_values
    if cache is not None and not isinstance(cache, LinearAttentionTransformerCache):
        raise TypeError(f"cache must be a LinearAttentionTransformerCache (what this model's forward and generate "
                        f"return), got {type(cache).__name__}")
    return cache


# the parameters an attention layer's global heads own, at the names older folders hold them
MOVED_PARAMETERS = {r"(?<!global_heads)\.(forget_gate|local_conv|to_beta)\.": r".global_heads.\1."}


class LinearAttentionTransformerForCausalLM(PreTrainedModel, GenerationMixin):
    """A causal ``LinearAttentionTransformerLM`` (``.model``) as a transformers causal LM.

    ``forward(input_ids, attention_mask, labels, cache, use_cache)`` runs ``self.model``'s
    forward, the library's one path: given a cache, ``input_ids`` holds only the new tokens
    (``attention_mask`` may span the whole sequence: its last columns are used). ``labels``
    (b, n), usually ``input_ids``, are shifted inside; -100 and padding (``attention_mask``
    0) are not scored: the loss of ``AutoregressiveWrapper(self.model)(input_ids)``.
    ``use_cache`` (default: only when a cache is given) returns a
    ``LinearAttentionTransformerCache`` under ``CACHE_NAME``. Tied and untied embeddings
    (``tie_embedding``) save and reload as they were. Parameters are initialised by the
    library's constructor; ``_init_weights`` only rebuilds the rotary table, which is not saved.
    ``wrap(model)`` makes one around a library model already built.
    """

    config_class = LinearAttentionTransformerConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    # (applies only with tie_word_embeddings, the alias of tie_embedding)
    _tied_weights_keys = {"model.to_logits.weight": "model.token_emb.weight"}

    def __init__(self, config: LinearAttentionTransformerConfig):
        super().__init__(config)
        if not config.causal:
            raise ValueError("causal=False: a causal LM predicts the next token and needs causal=True")
        if config.return_embeddings:
            raise ValueError("return_embeddings=True: a causal LM returns logits; use LinearAttentionTransformerLM "
                             "for the hidden states")
        # (model_options holds the library's option names only: the config checked the keys it was given)
        self.model = LinearAttentionTransformerLM(**config.model_options(), _keywords_checked=True)
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' ``from_pretrained``; a folder whose attention layers kept the global
        heads' gates, convolution and writing strengths on the layer itself loads as well."""
        kwargs.setdefault("key_mapping", MOVED_PARAMETERS)
        return super().from_pretrained(*args, **kwargs)

    @classmethod
    def wrap(cls, model):
        """``model``, a ``LinearAttentionTransformerLM``, as this class (for ``save_pretrained``,
        ``generate``, ``Trainer``), its config built from the keywords it was built with
        (``model.options``). The wrapper's ``.model`` is ``model`` itself, not a copy: training
        either trains both. The wrapper takes the model's training mode. ValueError as for a
        model built from a config (an option JSON cannot hold, ``causal=False``)."""
        if not isinstance(model, LinearAttentionTransformerLM):
            raise TypeError(f"model must be a LinearAttentionTransformerLM, got {type(model).__name__}")
        # (a keyword left out had the library's default, which for causal is not the config's)
        config = cls.config_class(**{"causal": _LIBRARY_DEFAULTS["causal"], **model.options})
        with torch.device("meta"):  # (its own model is replaced at once: no memory for it)
            wrapper = cls(config)
        wrapper.model = model
        return wrapper.train(model.training)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # generate must not make transformers' own cache: forward makes this model's
        return False

    def _init_weights(self, module):
        if isinstance(module, RotaryEmbedding):
            with torch.no_grad():
                module.inv_freq.copy_(module.inverse_frequencies(module.inv_freq.device))

    def get_input_embeddings(self):
        return self.model.token_emb

    def set_input_embeddings(self, value):
        self.model.token_emb = value

    def get_output_embeddings(self):
        return self.model.to_logits

    def set_output_embeddings(self, value):
        self.model.to_logits = value

    def forward(self, input_ids, attention_mask=None, labels=None, cache=None, past_key_values=None, use_cache=None,
                return_dict=None, inputs_embeds=None, output_attentions=None, output_hidden_states=None,
                cache_position=None):
        """-> ``CausalLMOutputWithPast`` (loss, logits (b, n, num_tokens), the cache), or its
        tuple with ``return_dict=False``. ``past_key_values``: the older name of ``cache``.
        ``cache_position`` is ignored (the cache knows its position); ``inputs_embeds``,
        ``output_attentions`` and ``output_hidden_states`` are not supported (ValueError)."""
        for name, value in (("inputs_embeds", inputs_embeds), ("output_attentions", output_attentions),
                            ("output_hidden_states", output_hidden_states)):
            if value is not None and value is not False:
                raise ValueError(f"{name} is not supported by {type(self).__name__}")
        cache = _the_cache(cache, past_key_values)
        if use_cache is None:
            use_cache = cache is not None
        mask = None
        if attention_mask is not None:
            n = input_ids.shape[-1]
            if attention_mask.ndim != 2 or attention_mask.shape[1] < n:
                raise ValueError(f"attention_mask must have shape (batch, at least {n} columns), got "
                                 f"{tuple(attention_mask.shape)}")
            mask = attention_mask[:, -n:].bool()
            if bool(mask.all()):  # (no padding: the model's faster unmasked form)
                mask = None
        state = None if cache is None else cache.state
        logits = self.model(input_ids, input_mask=mask, cache=state, return_cache=bool(use_cache))
        if use_cache:
            logits, state = logits
            cache = cache if cache is not None else LinearAttentionTransformerCache()
            cache.state = state
        loss = None if labels is None else self.loss_of(logits, labels, attention_mask)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: cache if use_cache else None})
        return out.to_tuple() if return_dict is False else out

    @staticmethod
    def loss_of(logits, labels, attention_mask=None, ignore_index=-100):
        """Mean next-token cross-entropy (in at least float32) of ``logits`` (b, n, num_tokens)
        against ``labels`` (b, n) shifted by one; labels equal to ``ignore_index`` and targets
        where ``attention_mask`` is 0 are not scored."""
        if labels.shape != logits.shape[:2]:
            raise ValueError(f"labels must have shape {tuple(logits.shape[:2])} (as input_ids), got {tuple(labels.shape)}")
        targets = labels[:, 1:].long()
        if attention_mask is not None:
            targets = targets.masked_fill(~attention_mask[:, -labels.shape[1] + 1:].bool(), ignore_index)
        scores = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None,
                                      use_cache=None, inputs_embeds=None, **generation_state):
        """The forward's keywords for one step of ``generate``: the tokens the cache has not
        consumed yet (all of them without a cache). ``generation_state``: what releases of
        transformers pass besides (``cache_position``, ``next_sequence_length``,
        ``is_first_iteration``, ...), not needed: the cache knows its position."""
        cache = _the_cache(cache, past_key_values)
        if cache is not None:
            done = cache.get_seq_length()
            if done >= input_ids.shape[1]:
                raise ValueError(f"the cache has consumed {done} tokens and input_ids holds {input_ids.shape[1]}: "
                                 f"pass the sequence with at least one token that follows the cache")
            input_ids = input_ids[:, done:]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "cache": cache, "use_cache": use_cache,
                "inputs_embeds": inputs_embeds}


def _byte_chars():
    """The character that the byte-level pre-tokenizer (GPT-2's table) writes for each byte:
    the printable Latin-1 bytes stand for themselves, the others for U+0100, U+0101, ... in
    byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, unprintable = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + unprintable))
            unprintable += 1
    return chars


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast`` whose ids are the UTF-8 bytes of the text (256 ids, the
    byte-level models of examples/), built here without the Hub. Any text round-trips
    (``decode(encode(text)) == text``); ``save_pretrained`` writes it and ``AutoTokenizer``
    reloads it.

    Byte 0 (NUL) is both ``eos_token`` and ``pad_token`` (lm-eval and batched ``generate`` need
    them; no id is added beyond the bytes), so ``skip_special_tokens=True`` drops NUL bytes.
    NUL in the text is still encoded as its byte (``split_special_tokens``), never matched as
    a special token. Returns ``input_ids`` and ``attention_mask`` only.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    backend = Tokenizer(models.BPE({char: byte for byte, char in enumerate(chars)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=chars[0], pad_token=chars[0],
                                   split_special_tokens=True, clean_up_tokenization_spaces=False,
                                   model_input_names=["input_ids", "attention_mask"])


AutoConfig.register(MODEL_TYPE, LinearAttentionTransformerConfig, exist_ok=True)
AutoModel.register(LinearAttentionTransformerConfig, LinearAttentionTransformerForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(LinearAttentionTransformerConfig, LinearAttentionTransformerForCausalLM, exist_ok=True)
