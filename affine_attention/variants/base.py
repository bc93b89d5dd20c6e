"""The module-side contract every attention variant follows; softmax is the base and the others override pieces."""
from __future__ import annotations

import colorsys
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, Union

import torch
from torch import Tensor, nn

from ..ops import sink_attention_reference, softmax_attention_reference
from ..ops.attention import attend_call
from ..ops.call import AttentionCall, Score
from ..ops.masks import MaskSpec


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one attention layer: hidden (model width), query heads, key/value heads, head dim."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"AttentionShape.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")


#: The Okabe-Ito palette: distinguishable under the common forms of colour blindness.
OKABE_ITO = {
    "black": "#000000", "orange": "#E69F00", "sky_blue": "#56B4E9", "bluish_green": "#009E73",
    "yellow": "#F0E442", "blue": "#0072B2", "vermillion": "#D55E00", "reddish_purple": "#CC79A7",
    "grey": "#999999",
}

# After the Okabe-Ito colours, Paul Tol's muted set (also safe for the common colour blindnesses); past both, hues
# spread by the golden angle, so no number of variants runs out of colours.
_TOL_MUTED = ("#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "p", "<", ">", "d", "H", "8")


def palette_colour(i: int) -> str:
    """The i-th colour a variant without its own is given (hex)."""
    fixed = (*OKABE_ITO.values(), *_TOL_MUTED)
    if i < len(fixed):
        return fixed[i]
    r, g, b = colorsys.hls_to_rgb((i * 0.381966) % 1.0, 0.45, 0.65)
    return "#{:02X}{:02X}{:02X}".format(round(r * 255), round(g * 255), round(b * 255))


def palette_marker(i: int) -> Union[str, tuple]:
    """The i-th marker a variant without its own is given: matplotlib's filled markers, then regular polygons
    (matplotlib's (sides, style, angle) form) with ever more sides."""
    return _MARKERS[i] if i < len(_MARKERS) else (i - len(_MARKERS) + 9, 0, 0)


Role = Literal["method", "baseline", "control"]


@dataclass(frozen=True)
class Display:
    """How every figure and report draws a variant: legend label, colour (hex), matplotlib marker and line style.

    Each registered variant has its own colour and its own marker (checked at registration), so lines stay apart in
    greyscale and for colour-blind readers. None: `register_variant` gives the first colour / marker of the palette
    no registered variant uses (`palette_colour`, `palette_marker`)."""

    label: str
    color: str | None = None
    marker: Union[str, tuple, None] = None
    linestyle: Union[str, tuple] = "-"


@dataclass(frozen=True)
class NoOptions:
    """Variants without options."""


class Prologue(NamedTuple):
    """What a variant's prologue computes from the layer input before the kernel runs; None = not used.

    alpha: (B, Hq, T) with alpha_ma: (Hq,) (the affine part; needs the mean of visible V); gate: broadcastable to
    (B, Hq, T, D) or a float, applied in the epilogue; sinks: (Hq,) logits, applied inside the kernel (needs its
    lse); bias_norm: how the affine bias term counts keys. A NamedTuple: built per layer per call, and cheaper to
    build than a frozen dataclass.
    """

    alpha: Tensor | None = None
    alpha_ma: Tensor | None = None
    gate: Tensor | float | None = None
    sinks: Tensor | None = None
    bias_norm: str = "visible"


class ForwardArgs(NamedTuple):
    """A variant module's forward arguments by name, as a forward (pre-)hook with_kwargs=True receives them
    (`ForwardArgs.of(args, kwargs)`): the per-call object, x: (B, T, hidden), token_mask: (B, T) bool or None,
    model_sinks: (Hq,) or None. Hooks, probes and recorders read the call from here, never from op keywords."""

    call: "AttentionCall"
    x: Tensor
    token_mask: Tensor | None = None
    model_sinks: Tensor | None = None

    @staticmethod
    def of(args: tuple, kwargs: dict[str, Any]) -> "ForwardArgs":
        return ForwardArgs(*args, **kwargs)

    def real_queries(self) -> Tensor | None:
        """(B, T) bool, True on real (unpadded) queries: the token mask where the layer had one, else the call's
        key padding at the query positions (query i is key position i + S - T); None when every query is real."""
        q, mask = self.call.q, self.call.mask
        B, _, T, _ = q.shape
        if self.token_mask is not None:
            return self.token_mask
        if mask.keys is not None and T <= mask.S and mask.keys.shape[0] == B:
            return mask.keys[:, 0, 0, mask.S - T:]
        return None


class AttentionVariant(nn.Module):
    """Softmax attention; subclasses override `prologue`, `output_gate` and `attend_reference` for what differs.

    The fast path is one call: prologue (alpha, gate, sinks from x) -> softmax kernel (the sink inside it) -> one
    epilogue pass (affine combine and gate together, ops/epilogue.py). `needs_lse` and `uses_value_mean` declare
    what the variant needs from the kernel; forward checks the prologue against them.

    forward(q, k, v, x) takes q: (B, Hq, T, D), k, v: (B, Hkv, S, D), the layer's input hidden states
    x: (B, T, hidden) (after the pre-norm: alpha and gates are computed from it) and returns (B, Hq, T, D),
    ready for the output projection. token_mask: (B, T) bool, True on real tokens (statistics skip padding).
    """

    name: ClassVar[str] = "softmax"
    Options: ClassVar[type] = NoOptions
    #: True when the variant wants the mean of visible V (decoding keeps a running sum for it).
    uses_value_mean: ClassVar[bool] = False
    #: True when the variant needs the kernel's log-sum-exp (a sink).
    needs_lse: ClassVar[bool] = False

    # --- facts the report, figures, metrics and compare read from the registry -----------------------------
    #: "method": a proposal of the paper; "baseline": an attention it is compared with; "control": exists only to
    #: separate a method's gain from something simpler (see `isolates`).
    role: ClassVar[Role] = "baseline"
    #: Controls this variant is compared with, paired by seed, when both are in a run.
    controls: ClassVar[tuple[str, ...]] = ()
    #: For a control: what "variant - this control" measures, in a few words.
    isolates: ClassVar[str] = ""
    display: ClassVar[Display] = Display("Softmax", OKABE_ITO["black"], "o", "-")
    #: Per-token statistics logged every training step as <key>_mean and <key>_std per layer (see
    #: `token_statistics`), key -> display label.
    token_stats: ClassVar[dict[str, str]] = {}
    #: Per-head state logged every step (mean over heads) and at every evaluation (per head) (see
    #: `state_statistics`), key -> display label.
    state_stats: ClassVar[dict[str, str]] = {}
    #: Options that older versions recorded in saved configs, with the neutral value they held then: dropped on
    #: load when they hold it (see `variants.parse_options`).
    retired_options: ClassVar[dict[str, Any]] = {}
    #: In a model whose attention already has learned sinks (GPT-OSS), "" means this variant runs its math on that
    #: sink softmax (the model's sinks stay in every denominator); any other text is why it refuses such a model.
    refuses_model_sinks: ClassVar[str] = ""
    #: "" when `convert(..., function_preserving=True)` can start this variant at the model's function (see
    #: `retrofit`); otherwise why it never can, whatever its options (`variants.can_retrofit` reads it).
    retrofit_refusal: ClassVar[str] = ""

    def __init__(self, shape: AttentionShape, options=None):
        super().__init__()
        if not isinstance(shape, AttentionShape):
            raise ValueError(f"{type(self).__name__}: shape must be an AttentionShape(hidden_size, num_heads, "
                             f"num_kv_heads, head_dim), got {type(shape).__name__} {shape!r}")
        if options is not None and not isinstance(options, self.Options):
            raise ValueError(f"{type(self).__name__}: options must be {self.Options.__name__} (build it with "
                             f"variants.parse_options), got {type(options).__name__}")
        self.shape = shape
        self.options = options if options is not None else self.Options()

    def __call__(self, *args, **kwargs):
        """The ops' keyword form, module(q, k, v, x, attn_mask=..., is_causal=..., scale=..., ...), becomes the
        per-call object here, before nn.Module runs any hook: every forward hook, probe and recorder sees
        forward(call, x, token_mask=..., model_sinks=...), whoever called."""
        if (args and isinstance(args[0], Tensor)) or "q" in kwargs:
            args, kwargs = self.call_of(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def call_of(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, *, attn_mask: Tensor | None = None,
                is_causal: bool = False, window: int | None = None, document_ids: Tensor | None = None,
                mask: MaskSpec | None = None, scale: float | None = None, token_mask: Tensor | None = None,
                v_mean: Tensor | None = None, backend: str | None = None, kv_nonfinite: Tensor | bool | None = None,
                softcap: float | None = None, model_sinks: Tensor | None = None) -> tuple[tuple, dict[str, Any]]:
        """The keyword form's (call, x) and keywords of `forward`. The mask either parsed (mask=) or as the op
        keywords attn_mask / is_causal / window / document_ids ((B, S) int); backend: as on the ops. v_mean and
        kv_nonfinite: what a decoding cache knows (see ops.attention.attention_with_epilogue). softcap: the
        model's logit cap (Gemma 2). model_sinks: (Hq,) the sink logits the model's own attention has (GPT-OSS's
        s_aux; see `adopt_model_sinks`)."""
        self._check_x(x, q)
        call = AttentionCall.of(q, k, v, attn_mask=attn_mask, is_causal=is_causal, window=window,
                                document_ids=document_ids, mask=mask, scale=scale, softcap=softcap,
                                enable_gqa=self._gqa, v_mean=v_mean, kv_nonfinite=kv_nonfinite, backend=backend)
        return (call, x), {"token_mask": token_mask, "model_sinks": model_sinks}

    def forward(self, call: AttentionCall, x: Tensor, *, token_mask: Tensor | None = None,
                model_sinks: Tensor | None = None) -> Tensor:
        """call: this layer call (q (B, Hq, T, D), k, v (B, Hkv, S, D), mask, score, cache hints); x: (B, T, hidden)
        the attention input. token_mask: (B, T) bool, True on real tokens (statistics skip padding); model_sinks:
        (Hq,) the model's own sink logits or None. Returns (B, Hq, T, D)."""
        if not isinstance(call, AttentionCall):
            raise ValueError(f"{self.name}: forward takes an ops.call.AttentionCall (or call the module with q, k, v, "
                             f"x and the op keywords), got {type(call).__name__}")
        self._check_x(x, call.q)
        if token_mask is not None and (not isinstance(token_mask, Tensor) or token_mask.dtype != torch.bool
                                       or tuple(token_mask.shape) != tuple(x.shape[:2])):
            got = (f"{token_mask.dtype} {tuple(token_mask.shape)}" if isinstance(token_mask, Tensor)
                   else type(token_mask).__name__)
            raise ValueError(f"token_mask must be a bool tensor (B, T) = {tuple(x.shape[:2])}, True on real tokens; "
                             f"got {got} (convert an attention mask with `.bool()`)")
        if token_mask is not None and token_mask.device != x.device:
            raise ValueError(f"token_mask is on {token_mask.device} but x is on {x.device}; move it with "
                             "`token_mask.to(x.device)`")
        return self.attend(call, x, token_mask=token_mask, model_sinks=model_sinks)

    def reference(self, q: Tensor, k: Tensor, v: Tensor, x: Tensor, *, attn_mask: Tensor | None = None,
                  is_causal: bool = False, window: int | None = None, document_ids: Tensor | None = None,
                  mask: MaskSpec | None = None, scale: float | None = None, softcap: float | None = None,
                  model_sinks: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """Eager form for analysis: (out (B, Hq, T, D), weights (B, Hq, T, S), extras such as alpha or sink mass).

        Never updates state (alpha_ma stays as it is). The mask, softcap and model_sinks as in `call_of`."""
        (call, x), _ = self.call_of(q, k, v, x, attn_mask=attn_mask, is_causal=is_causal, window=window,
                                    document_ids=document_ids, mask=mask, scale=scale, softcap=softcap)
        return self.reference_of(call, x, model_sinks)

    def reference_of(self, call: AttentionCall, x: Tensor,
                     model_sinks: Tensor | None = None) -> tuple[Tensor, Tensor, dict[str, Any]]:
        """`reference` of a built call: the variant's score hook applied, then the float64-readable references."""
        q = call.q
        sinks = self._model_sinks(model_sinks, None)
        out, w, extras = self.attend_reference(q, call.k, call.v, x, mask=call.mask, score=self.score(call, x),
                                               sinks=None if sinks is None else sinks.to(q.dtype))
        if sinks is not None and "sink_mass" not in extras:
            extras = {**extras, "sink_mass": 1.0 - w.sum(-1)}
        gate = self.output_gate(x)  # the readable form of the epilogue's gate: one multiply
        return (out if gate is None else out * gate), w, extras

    # --- what subclasses override -------------------------------------------------------------
    def prologue(self, x: Tensor, token_mask: Tensor | None) -> Prologue:
        """Per-token inputs from x: (B, T, hidden); called once per forward (it may accumulate running statistics)."""
        return Prologue(gate=self.output_gate(x))

    def output_gate(self, x: Tensor) -> Tensor | float | None:
        """The epilogue's output gate from x: (B, T, hidden), broadcastable to (B, Hq, T, D); None for softmax."""
        return None

    def score(self, call: AttentionCall, x: Tensor) -> Score:
        """The score hook: how this variant makes logits for `call` (x: (B, T, hidden)). The default keeps the
        call's (scale and the model's softcap); a variant that changes logits returns e.g.
        `call.score.with_q_scale(s)` with s: (B|1, Hq, T), or a Score with its own elementwise `fn`. The fast path
        and the reference both apply what it returns; a backend that cannot is never handed the call."""
        return call.score

    def attend(self, call: AttentionCall, x: Tensor, *, token_mask: Tensor | None = None,
               model_sinks: Tensor | None = None) -> Tensor:
        """The fast path: prologue, the score hook, then one kernel and one epilogue (ops.attention.attend_call)."""
        p = self.prologue(x, token_mask)
        # A sink variant that adopted the model's sinks has none of its own: they come as model_sinks.
        sinks_ok = (p.sinks is not None) == self.needs_lse or (p.sinks is None and model_sinks is not None)
        if not sinks_ok or (p.alpha is not None) != self.uses_value_mean:
            raise ValueError(f"variant {self.name!r}: its prologue does not match what it declares it needs from "
                             f"the kernel (needs_lse={self.needs_lse}, uses_value_mean={self.uses_value_mean})")
        sinks = self._model_sinks(model_sinks, p.sinks)
        cache = call.cache if p.alpha is not None else call.cache._replace(v_mean=None)
        call = call._replace(score=self.score(call, x), cache=cache)
        return attend_call(call, alpha=p.alpha, alpha_ma=p.alpha_ma, gate=p.gate, sinks=sinks, bias_norm=p.bias_norm)

    # mask: the call's MaskSpec; score: what the score hook returned; sinks: (Hq,) the sink logits in force (the
    # model's, or None), in q's dtype. The float64-readable form of `attend`: (out, weights (B, Hq, T, S), extras).
    def attend_reference(self, q, k, v, x, *, mask: MaskSpec, score: Score, sinks=None):
        if sinks is None:
            out, w = softmax_attention_reference(q, k, v, mask=mask, score=score, enable_gqa=self._gqa)
        else:
            out, w = sink_attention_reference(q, k, v, sinks, mask=mask, score=score, enable_gqa=self._gqa)
        return out, w, {}

    # --- a model whose attention has learned sinks of its own (GPT-OSS) ----------------------------------------
    def adopt_model_sinks(self) -> None:
        """Called when this module is attached to a model whose attention already has learned sinks: from then on
        every call passes them as `model_sinks`. ValueError (with `refuses_model_sinks`) if this variant cannot
        keep them; the sink variant makes them its own sink parameters instead of adding a second set."""
        if self.refuses_model_sinks:
            raise ValueError(self.refuses_model_sinks)

    def _model_sinks(self, model_sinks: Tensor | None, own: Tensor | None) -> Tensor | None:
        """The sink logits of a call: the variant's own, or the model's (never both: that would be two sinks)."""
        if model_sinks is None:
            return own
        if self.refuses_model_sinks:
            raise ValueError(self.refuses_model_sinks)
        if own is not None:
            raise ValueError(f"variant {self.name!r} has sink logits of its own and was handed the model's "
                             "(model_sinks); build it through convert(), which makes the model's sinks its own")
        return model_sinks

    # --- logged statistics (keys as declared in token_stats / state_stats) -------------------------------------
    def token_statistics(self, x: Tensor) -> dict[str, Tensor]:
        """x: (B, T, hidden) -> {key: (B, Hq, T)} per-token values of this layer, without updating any state."""
        return {}

    def state_statistics(self) -> dict[str, Tensor]:
        """{key: (Hq,)} per-head parameters or running buffers (may be FSDP2 DTensors)."""
        return {}

    @property
    def value_mean_norm(self) -> str:
        """How the mean of V this variant reads (`uses_value_mean`) counts keys: "visible" (the keys each query may
        see) or "full" (every key of the row, an ablation). The decode cache keeps its running sum to match."""
        return "visible"

    def retrofit(self) -> float:
        """Put a freshly built module into its function-preserving state and return c > 0 such that its output then
        equals c times softmax attention's (the caller folds 1 / c into the output projection).

        Called by `convert(..., function_preserving=True)` on new modules only; every new parameter must still
        receive gradient in that state. Variants that cannot preserve the function raise ValueError: always those
        that declare `retrofit_refusal`, others for some options."""
        if self.retrofit_refusal:
            raise ValueError(self.retrofit_refusal)
        return 1.0

    def retrofit_weight_scale(self) -> float:
        """In the function-preserving state, this variant's attention weights (what `reference` returns) are this
        factor times softmax's; the diagnostics divide it out to compare what training changed. 1 unless the
        variant scales the weights themselves (not only its output)."""
        return 1.0

    # --- helpers ------------------------------------------------------------------------------
    @property
    def _gqa(self) -> bool:
        return self.shape.num_heads != self.shape.num_kv_heads

    def _check_x(self, x: Tensor, q: Tensor) -> None:
        if not isinstance(x, Tensor) or not isinstance(q, Tensor):
            raise ValueError(f"{self.name}: q must be the (B, Hq, T, D) queries and x the (B, T, hidden) attention "
                             f"input (after the pre-norm), got q {type(q).__name__} and x {type(x).__name__}")
        if q.dim() != 4:
            raise ValueError(f"q must have rank 4 (B, Hq, T, D), got shape {tuple(q.shape)}")
        B, Hq, T, _ = q.shape
        if x.dim() != 3 or x.shape[0] != B or x.shape[1] != T or x.shape[2] != self.shape.hidden_size:
            raise ValueError(f"x (the attention input) must have shape (B, T, hidden) = "
                             f"{(B, T, self.shape.hidden_size)}, got {tuple(x.shape)}")
        if Hq != self.shape.num_heads:
            raise ValueError(f"q has {Hq} heads, this {self.name} layer was built for {self.shape.num_heads}")
        if not x.is_floating_point() or x.device != q.device:
            raise ValueError(f"x must be a floating-point tensor on q's device ({q.device}), got {x.dtype} on "
                             f"{x.device}")
        if (x.dtype == torch.float64) != (q.dtype == torch.float64):
            # Lower precisions may mix under autocast; float64 is all or nothing (the reference checks run in it).
            raise ValueError(f"x is {x.dtype} but q is {q.dtype}: float64 must be used for both (and for the "
                             "module: `.double()`) or for neither")
        p = next(self.parameters(), None) if x.dtype == torch.float64 else None  # asked only where it can differ
        if p is not None and p.dtype != torch.float64:
            raise ValueError(f"x is {x.dtype} but this {self.name} layer's parameters are {p.dtype}: float64 must be "
                             "used for the inputs and the module (`.double()`) or for neither")

    def extra_repr(self) -> str:
        return f"variant={self.name!r}, options={self.options}"
